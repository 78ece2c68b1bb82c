"""``hvd_magic.keras.elastic``: Horovod's Keras elastic callbacks and state over
:mod:`hvd_magic.tensorflow.elastic`::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs - state.epoch, callbacks=[
            hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.UpdateEpochStateCallback(state)])

After a lost rank, ``fit`` runs again on the survivors from the last commit. Keras 3 restarts
an interrupted epoch from its first batch (its epoch loop does not take a shortened step count
from a callback, as Keras 2's did); ``state.batch`` says where the epoch was.
"""
from __future__ import annotations

from typing import Any

from hvd_magic.tensorflow._compat import import_tf_keras
from hvd_magic.tensorflow.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                                          TensorFlowKerasState, run)

keras = import_tf_keras()   # the callbacks subclass the Callback of tf.keras's Keras

__all__ = ["run", "State", "ObjectState", "KerasState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "HostsUpdatedInterrupt"]


class KerasState(TensorFlowKerasState):
    """The model, its optimizer and picklable attributes (Horovod's ``KerasState``)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any):
        super().__init__(model, optimizer=optimizer, backend=None, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` every ``batches_per_commit`` batches and at the end of each epoch."""

    def __init__(self, state: Any, batches_per_commit: int = 1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the last finished batch of the epoch (0 after an epoch)."""

    def __init__(self, state: Any):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` as the number of epochs finished over every reset (Keras counts
    from 0 again in each ``fit``)."""

    def __init__(self, state: Any):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
