"""``DistributedOptimizer`` (an ``mx.optimizer.Optimizer``) and ``DistributedTrainer`` (a
``gluon.Trainer``): the gradients are averaged over the ranks before each update.

Averaging is split as Horovod splits it: each gradient is multiplied by
``1 / gradient_predivide_factor`` before the sum and by ``gradient_predivide_factor / n``
after it (n ranks of the process set), so the result is the mean either way. Gradients of one
step are submitted together and negotiated in one cycle (fused), or in ``num_groups``
grouped allreduces.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Sequence

import mxnet as mx

import hvd_magic.collectives as C
from hvd_magic.collectives import Average, ProcessSet, global_process_set

from .compression import Compression
from .plan import check_predivide, group_by_dtype, split_list
from .tensors import mx_errors, to_numpy, write_into


def allreduce_grads_(grads: Sequence[Any], names: Sequence[str], predivide: float,
                     num_groups: int, process_set: ProcessSet) -> None:
    """Average ``grads`` (NDArrays) in place over ``process_set``: all submitted at once,
    then written back."""
    pre, post = 1.0 / predivide, predivide
    pending = []
    with mx_errors():
        if num_groups > 0:
            chunks = split_list(list(zip(grads, names)), num_groups)
            for chunk in chunks:
                for run in group_by_dtype(chunk):
                    ts = [t for t, _ in run]
                    h = C.grouped_allreduce_async([to_numpy(t, "DistributedTrainer") for t in ts],
                                                  name=f"{run[0][1]}:{run[-1][1]}", op=Average,
                                                  prescale_factor=pre, postscale_factor=post,
                                                  process_set=process_set)
                    pending.append((ts, h))
        else:
            for g, name in zip(grads, names):
                h = C.allreduce_async(to_numpy(g, "DistributedTrainer"), name=name, op=Average,
                                      prescale_factor=pre, postscale_factor=post,
                                      process_set=process_set)
                pending.append(([g], h))
        done = [(ts, h.wait()) for ts, h in pending]
    for ts, out in done:
        outs = out if isinstance(out, (list, tuple)) else [out]
        for t, o in zip(ts, outs):
            write_into(t, o)


def _needs_allreduce(process_set: ProcessSet) -> bool:
    return bool(process_set.included()) and (process_set.size() or 1) > 1


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wrap an ``mx.optimizer.Optimizer``: ``update`` first averages the gradient over the
    ranks of ``process_set`` (in place), then lets the wrapped optimizer update. Every other
    attribute is the wrapped optimizer's. Example, 2 ranks, one weight::

        rank 0: grad = [1., 3.]  ->  update sees [2., 2.]
        rank 1: grad = [3., 1.]  ->  update sees [2., 2.]
    """

    def __init__(self, optimizer: Any, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set):
        # (no super().__init__: the state lives in the wrapped optimizer, as in Horovod)
        self._optimizer = optimizer
        self._gradient_predivide_factor = check_predivide(gradient_predivide_factor)
        self._num_groups = num_groups
        self._process_set = process_set

    def __getattr__(self, item: str) -> Any:
        if item == "_optimizer":          # (during unpickling, before __init__)
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, item: str, value: Any) -> None:
        # a gluon.Trainer sets rescale_grad and param_dict on its optimizer: they must reach
        # the wrapped one, which does the update
        if item.startswith("_"):
            object.__setattr__(self, item, value)
        else:
            setattr(self._optimizer, item, value)

    def create_state(self, index: Any, weight: Any) -> Any:
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: Any) -> Any:
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index: Any, grad: Any) -> None:
        if not _needs_allreduce(self._process_set):
            return
        if isinstance(index, (tuple, list)):
            grads, names = list(grad), [str(i) for i in index]
        else:
            grads, names = [grad], [str(index)]
        allreduce_grads_(grads, names, self._gradient_predivide_factor, self._num_groups,
                         self._process_set)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: Any) -> None:
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: Any) -> None:
        self._optimizer.set_wd_mult(args_wd_mult)


def _sorted_params(params: Any) -> Any:
    """The same parameter order on every rank: a dict keeps its order, a list is sorted by
    name (as Horovod sorts it)."""
    if isinstance(params, dict):
        return OrderedDict(params)
    if isinstance(params, (list, tuple)):
        return sorted(params, key=lambda p: getattr(p, "name", str(p)))
    return params


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` whose ``step`` averages each gradient over the ranks of
    ``process_set`` (in place, before the update) instead of using a kvstore.

    ``compression`` (``hvd.Compression.fp16``) shrinks what travels;
    ``gradient_predivide_factor`` splits the averaging around the sum (see the module);
    ``prefix`` keeps the tensor names of two trainers in one program apart; ``num_groups > 0``
    reduces the gradients in that many grouped allreduces. Example, 2 ranks::

        rank 0: w.grad = [1., 3.]; trainer.step(1)  ->  update with [2., 2.]
        rank 1: w.grad = [3., 1.]; trainer.step(1)  ->  update with [2., 2.]
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: Any = None,
                 compression: Any = Compression.none, gradient_predivide_factor: float = 1.0,
                 prefix: Any = None, num_groups: int = 0, process_set: ProcessSet = global_process_set):
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"DistributedTrainer: prefix must be a string, got {prefix!r}")
        factor = check_predivide(gradient_predivide_factor)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take a DistributedOptimizer as its "
                          "optimizer; the optimizer inside it is used", stacklevel=2)
        super().__init__(_sorted_params(params), optimizer, optimizer_params=optimizer_params,
                         kvstore=None)
        self._compression = compression
        self._process_set = process_set
        self._gradient_predivide_factor = factor
        self._prefix = prefix or ""
        self._num_groups = num_groups

    def _allreduce_grads(self) -> None:
        if not _needs_allreduce(self._process_set):
            return
        grads, names, ctxs, slots = [], [], [], []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grad = param.list_grad()[0]
            compressed, ctx = self._compression.compress(grad)
            grads.append(compressed)
            names.append(self._prefix + str(i))
            ctxs.append(ctx)
            slots.append(grad)
        allreduce_grads_(grads, names, self._gradient_predivide_factor, self._num_groups,
                         self._process_set)
        if self._compression is not Compression.none:
            for grad, compressed, ctx in zip(slots, grads, ctxs):
                if compressed is not grad:
                    grad[:] = self._compression.decompress(compressed, ctx)
