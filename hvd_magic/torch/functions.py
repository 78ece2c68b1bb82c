"""Start every rank from the root's model and optimizer: ``broadcast_parameters``,
``broadcast_optimizer_state`` (plus the object collectives, re-exported)."""
from __future__ import annotations

from typing import Any

import torch

import hvd_magic.collectives as C
from hvd_magic.collectives import allgather_object, broadcast_object

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Overwrite, in place, every rank's tensors with ``root_rank``'s.

    ``params`` is ``model.state_dict()``, a dict of tensors, or a list of
    ``model.named_parameters()`` pairs or of tensors. Example, 2 ranks::

        rank 0: fc.weight = [[0.1, 0.2]]  ->  [[0.1, 0.2]]
        rank 1: fc.weight = [[0.7, 0.3]]  ->  [[0.1, 0.2]]
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"broadcast_parameters takes model.state_dict(), a dict of tensors or a "
                         f"list of (name, tensor) pairs, not {type(params).__name__}")
    handles = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name or 'an entry'} is a {type(p).__name__}, "
                            "not a tensor; use broadcast_object for other values")
        handles.append(C.broadcast_async_(p.data, root_rank,
                                          name=None if name is None else f"broadcast.param.{name}"))
    for h in handles:
        h.wait()


def _describe(value: Any) -> Any:
    """What a non-root rank needs to receive ``value``: a tensor spec, or the value itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type == "cpu")
    return ("value", value)


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """Horovod initializes a new optimizer's state with a step on zero gradients, which
    leaves every parameter with a zero ``grad``; here the grads are set, without the step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state: hyper-parameters of each param group
    (lr, momentum, betas, ...) and per-parameter state (momentum buffers, step counts).

    Works before the first step too: when the root has no state yet, every rank drops its
    state, so all start fresh alike. Parameters are never changed; on a rank whose optimizer
    has no state yet, parameters that require a gradient and have none get a zero gradient
    (sparse for SparseAdam), as Horovod's leaves them. Example, 2 ranks::

        rank 0: lr=0.1,  state[p]['momentum_buffer'] = [1., 2.]  ->  unchanged
        rank 1: lr=0.05, state[p] = {}                           ->  lr=0.1, [1., 2.]
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, "
                        f"not {type(optimizer).__name__}")
    root = C.api.check_root(root_rank)
    sd = optimizer.state_dict()
    if not sd["state"]:
        _zero_missing_grads(optimizer)
    me = C.rank()
    if me == root:
        meta = {"param_groups": sd["param_groups"],
                "state": {pid: {k: _describe(v) for k, v in st.items()} for pid, st in sd["state"].items()}}
    else:
        meta = None
    meta = C.broadcast_object(meta, root_rank=root)
    mine = [len(g["params"]) for g in sd["param_groups"]]
    theirs = [len(g["params"]) for g in meta["param_groups"]]
    if mine != theirs:
        raise ValueError(f"broadcast_optimizer_state: rank {me}'s optimizer has param groups of sizes "
                         f"{mine}, rank {root}'s has {theirs}; build the same optimizer on every rank")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    flat = {pid: i for i, pid in enumerate(q for g in meta["param_groups"] for q in g["params"])}
    state: dict = {}
    handles = []
    for pid in sorted(meta["state"], key=str):
        entry: dict = {}
        local = sd["state"].get(pid)     # state_dict numbers parameters 0.. in the same order
        param = params[flat[pid]]
        for key in sorted(meta["state"][pid], key=str):
            spec = meta["state"][pid][key]
            if spec[0] == "value":
                entry[key] = spec[1]
                continue
            _, shape, dtype, on_cpu = spec
            t = None if local is None else local.get(key)
            if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype):
                t = torch.empty(shape, dtype=dtype, device="cpu" if on_cpu else param.device)
            handles.append(C.broadcast_async_(t, root, name=f"broadcast.optimizer_state.{pid}.{key}"))
            entry[key] = t
        state[pid] = entry
    for h in handles:
        h.wait()
    if me != root:
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})

