"""``hvd_magic.tensorflow.elastic``: Horovod's elastic training for TensorFlow and Keras
(``run``, ``TensorFlowKerasState``, ``TensorFlowState``, ``ObjectState``), surviving a lost rank
through MPI's fault tolerance (see :mod:`hvd_magic.collectives.elastic`); scripts run with
``hvdrun --min-np N -np M``. After a loss the survivors restore the last commit (weights and
optimizer variables as saved numpy copies), start again on a smaller communicator, and
``sync()`` broadcasts the state from the new rank 0 before ``func`` runs again.
"""
from __future__ import annotations

from typing import Any, Callable, List

import hvd_magic.collectives as C
from hvd_magic.collectives.elastic import HostsUpdatedInterrupt, ObjectState, State, run_fn, shrink

from .functions import broadcast_object, broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState",
           "HostsUpdatedInterrupt"]


def run(func: Callable) -> Callable:
    """Decorate ``func(state, ...)``: it runs again on the survivors, from ``state``'s last
    commit, when a rank is lost (Horovod's ``hvd.elastic.run``). Every rank calls it."""
    return run_fn(func, shrink)


class _VariablesState(ObjectState):
    """Committed copies of some TensorFlow variables plus picklable attributes."""

    def __init__(self, **kwargs: Any):
        super().__init__(lambda obj: broadcast_object(obj, root_rank=0, name="elastic.state"),
                         C.rank, **kwargs)
        self._hvd_values: List[Any] = []
        self._save_vars()

    def _variables(self) -> List[Any]:
        raise NotImplementedError

    def _save_vars(self) -> None:
        self._hvd_values = [v.numpy() for v in self._variables()]

    def save(self) -> None:
        self._save_vars()
        super().save()

    def restore(self) -> None:
        vs = self._variables()
        if len(vs) == len(self._hvd_values):      # (none saved yet: a model built since)
            for v, x in zip(vs, self._hvd_values):
                v.assign(x)
        super().restore()

    def sync(self) -> None:
        vs = self._variables()
        if vs:
            broadcast_variables(vs, root_rank=0)
        self._save_vars()
        super().sync()


class TensorFlowKerasState(_VariablesState):
    """A Keras model's weights and its optimizer's variables, plus picklable attributes
    (``epoch=0, batch=0``). ``backend`` is accepted for Horovod's signature."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def _variables(self) -> List[Any]:
        opt = self.optimizer
        opt_vars = list(getattr(opt, "variables", []) or []) if opt is not None else []
        return list(self.model.variables) + opt_vars

    def sync(self) -> None:
        # A rank that joined a growing job has applied no step yet, so its optimizer has no
        # slot variables (Adam's moments, ...) while the others have: build them first, so
        # every rank broadcasts the same list of variables.
        opt = self.optimizer
        if opt is not None and getattr(opt, "built", True) is False and hasattr(opt, "build"):
            opt.build(self.model.trainable_variables)
        super().sync()


class TensorFlowState(_VariablesState):
    """A list of ``tf.Variable`` plus picklable attributes. ``session`` (TF1) is not supported:
    eager TensorFlow 2 only."""

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any):
        if session is not None:
            raise ValueError("TensorFlowState(session=...): TF1 sessions are not supported by "
                             "hvd_magic's elastic mode; use eager TensorFlow 2")
        self.variables = list(variables or [])
        super().__init__(**kwargs)

    def _variables(self) -> List[Any]:
        return self.variables
