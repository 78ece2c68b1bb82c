"""``hvd_magic.torch.elastic``: Horovod's elastic training for PyTorch (``hvd.elastic.run``,
``TorchState``, ``ElasticSampler``), surviving a lost rank through MPI's fault tolerance (see
:mod:`hvd_magic.collectives.elastic`). Run scripts with ``hvdrun --min-np N -np M``::

    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, start=state.batch) ...
                ...; state.sampler.record_batch(state.batch, batch_size)
                if state.batch % 10 == 0: state.commit()
            state.batch = 0; state.sampler.set_epoch(state.epoch + 1)

    train(state)

A rank killed mid-epoch: the others restore the last commit, go on with one rank fewer from
there, and the sampler shares the epoch's samples not yet committed among them.
"""
from __future__ import annotations

import copy
import math
import random
from typing import Any, Callable, Dict, Iterator

import torch

import hvd_magic.collectives as C
from hvd_magic.collectives.elastic import HostsUpdatedInterrupt, ObjectState, State, run_fn, shrink

from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "HostsUpdatedInterrupt"]


def run(func: Callable) -> Callable:
    """Decorate ``func(state, ...)``: it runs again on the survivors, from ``state``'s last
    commit, when a rank is lost (Horovod's ``hvd.elastic.run``). Every rank calls it."""
    return run_fn(func, shrink)


class ElasticSampler(torch.utils.data.Sampler):
    """Each rank's share of an epoch, shared again among the ranks left after a reset.

    The epoch's order is a shuffle seeded by ``seed + epoch`` (the same on every rank);
    ``record_batch`` counts the samples every rank together has processed; what remains is
    dealt round-robin: with 8 samples left on 2 ranks, rank 0 gets remaining[0, 2, 4, 6] and
    rank 1 gets remaining[1, 3, 5, 7]. When the remainder does not divide evenly the last
    samples are repeated so every rank takes the same number of steps (as
    ``DistributedSampler``). Call ``set_epoch(e + 1)`` at the *end* of epoch ``e``.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """``batch_size`` samples of this rank's share were processed (on every rank)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Any) -> None:
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch, self.processed_num = state["epoch"], state["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Deal the epoch's remaining samples among the ranks there are now."""
        self.num_replicas = C.size() if C.is_initialized() else 1
        self.rank = C.rank() if C.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def get_indices(self) -> list:
        padded = self.remaining_indices + self.remaining_indices[:self.total_size - len(self.remaining_indices)]
        return padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.get_indices())

    def __len__(self) -> int:
        return self.num_samples


class TorchState(ObjectState):
    """A model, an optimizer and any other attributes, committed together.

    The model and optimizer are saved as copies of their ``state_dict()`` and synced with
    ``broadcast_parameters`` / ``broadcast_optimizer_state`` from rank 0; an attribute with a
    ``state_dict()`` (an :class:`ElasticSampler`) the same way, and is ``reset()`` after a
    reset; other attributes are pickled and broadcast.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any):
        self.model, self.optimizer = model, optimizer
        self._hvd_stateful = {k: v for k, v in kwargs.items() if hasattr(v, "state_dict")}
        for k, v in self._hvd_stateful.items():
            setattr(self, k, v)
        plain = {k: v for k, v in kwargs.items() if k not in self._hvd_stateful}
        super().__init__(broadcast_object, C.rank, **plain)
        self._hvd_saved_dicts: Dict[str, Any] = {}
        self._save_dicts()

    def _objects(self) -> Dict[str, Any]:
        out = dict(self._hvd_stateful)
        if self.model is not None:
            out["model"] = self.model
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer
        return out

    def _save_dicts(self) -> None:
        self._hvd_saved_dicts = {k: copy.deepcopy(v.state_dict())
                                 for k, v in self._objects().items()}

    def save(self) -> None:
        self._save_dicts()
        super().save()

    def restore(self) -> None:
        if hasattr(self.optimizer, "synchronize"):
            try:   # ends the interrupted step: its requests failed; gradients are dropped
                self.optimizer.synchronize()
            except C.HvdError:
                pass
        for k, v in self._objects().items():
            v.load_state_dict(copy.deepcopy(self._hvd_saved_dicts[k]))
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for k, v in self._hvd_stateful.items():
            v.load_state_dict(broadcast_object(v.state_dict(), root_rank=0, name=f"elastic.{k}"))
        self._save_dicts()
        super().sync()

    def reset(self) -> None:
        for v in self._hvd_stateful.values():
            if hasattr(v, "reset"):
                v.reset()
