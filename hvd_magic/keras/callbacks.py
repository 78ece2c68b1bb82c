"""The callbacks of ``horovod.tensorflow.keras.callbacks``, subclasses of ``tf.keras``'s Callback
(Keras 3; or Keras 2, ``tf_keras``, under ``TF_USE_LEGACY_KERAS=1``)::

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),   # every rank starts from rank 0
        hvd.callbacks.MetricAverageCallback(),               # epoch logs averaged over ranks
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1 * hvd.size(), warmup_epochs=3),
    ]
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint("ckpt.keras"))

Put MetricAverageCallback before callbacks that read the logs (checkpoints, early stopping).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import numpy as np

import hvd_magic.collectives as C
from hvd_magic.tensorflow._compat import import_keras, import_tf, import_tf_keras
from hvd_magic.tensorflow.functions import broadcast_variables
from hvd_magic.tensorflow.gradient_aggregation import var_key

tf = import_tf()
keras = import_tf_keras()     # the Keras whose fit() runs these callbacks
_VARIABLE_TYPES = (tf.Variable, import_keras().Variable)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, overwrite every rank's model variables and optimizer
    variables with ``root_rank``'s, so that all ranks start identical (use it when the
    model is initialized randomly or restored on one rank only). ``local_variables`` (a
    variable or a list of them; more with ``register_local_var``) keep each rank's value.

    Example, 2 ranks, root_rank=0, w local::

        rank 0: (v, w) = (1, 1) -> (1, 1)    rank 1: (v, w) = (2, 2) -> (1, 2)
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None):
        super().__init__()
        C.api.check_root(root_rank)
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._optimizer_done = False
        self._local_vars: set = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        if not all(_is_variable(v) for v in local_variables):
            raise ValueError("local_variables must be a variable or a list of variables "
                             "(tf.Variable or keras.Variable)")
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Do not broadcast ``var``: it keeps this rank's value."""
        self._local_vars.add(var_key(var))

    def _broadcast_optimizer(self) -> None:
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and optimizer_built(opt) and not self._optimizer_done:
            found = opt.variables
            broadcast_variables(found() if callable(found) else found, self.root_rank)
            self._optimizer_done = True

    def _broadcast_model(self) -> None:
        broadcast_variables([v for v in self.model.variables if var_key(v) not in self._local_vars],
                            self.root_rank)
        self._broadcast_optimizer()
        self.broadcast_done = True

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        # a Keras 2 model given no input shape gets its weights from the first batch: then
        # the broadcast follows that batch, as Horovod's does
        if not self.broadcast_done and getattr(self.model, "built", True):
            self._broadcast_model()

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if not self.broadcast_done:
            self._broadcast_model()
        # an optimizer built lazily by the first step: its slots follow the root's
        self._broadcast_optimizer()


def _is_variable(v: Any) -> bool:
    return isinstance(v, _VARIABLE_TYPES)


def optimizer_built(opt: Any) -> bool:
    """True once ``opt`` has made its variables (slots): Keras 3's ``built``, Keras 2's
    ``_built``; Keras 2's legacy optimizers make them on the first update."""
    for flag in ("built", "_built"):
        if hasattr(opt, flag):
            return bool(getattr(opt, flag))
    weights = getattr(opt, "weights", None)
    return bool(weights)


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace every numeric entry of the logs (loss, metrics,
    validation metrics) with its average over all ranks, so that every rank sees, prints and
    checkpoints on the same numbers."""

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is None or C.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        mine = [str(k) for k in keys]
        if C.allgather_object(mine) != [mine] * C.size():
            raise ValueError(f"MetricAverageCallback: ranks logged different metrics at epoch "
                             f"{epoch}; compile the same metrics on every rank")
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        avg = C.allreduce(values, name=f"MetricAverageCallback.{epoch}")
        for k, v in zip(keys, avg):
            logs[k] = float(v)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float, np.number)):
        return True
    return (isinstance(v, (tf.Tensor, np.ndarray)) and getattr(v, "shape", None) == ()
            and np.issubdtype(np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)), np.number))


def _set_lr(optimizer: Any, lr: float) -> None:
    lr_attr = getattr(optimizer, "_learning_rate", None)
    if isinstance(lr_attr, keras.optimizers.schedules.LearningRateSchedule) or callable(lr_attr):
        raise ValueError("the optimizer's learning rate is a schedule; the hvd_magic learning-rate "
                         "callbacks set a fixed value each step: create the optimizer with a float "
                         "learning_rate")
    optimizer.learning_rate = lr


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up to
    (not including) ``end_epoch``. ``multiplier`` is a number or a function of the epoch; with
    ``staircase=True`` it is applied at each epoch's start with the integer epoch, otherwise
    at each batch with the fractional epoch ``epoch + batch / steps_per_epoch``.

    Example: ``LearningRateScheduleCallback(0.1, multiplier=0.1, start_epoch=30)`` trains at
    lr 0.01 from epoch 30 on. ``momentum_correction`` is accepted for Horovod compatibility
    and does nothing: Keras 3 compiles the momentum into the train step.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0):
        super().__init__()
        try:
            self.initial_lr = float(initial_lr)
        except (TypeError, ValueError):
            raise TypeError(f"initial_lr must be a number (the learning rate before scaling), got "
                            f"{initial_lr!r}") from None
        if callable(multiplier):
            self.multiplier: Callable[[float], float] = multiplier
        elif isinstance(multiplier, (int, float)) and not isinstance(multiplier, bool):
            self.multiplier = lambda epoch, m=float(multiplier): m
        else:
            raise TypeError(f"multiplier must be a number or a function of the epoch, got {multiplier!r}")
        if end_epoch is not None and end_epoch <= start_epoch:
            raise ValueError(f"end_epoch ({end_epoch}) must be greater than start_epoch ({start_epoch})")
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        lr = self.initial_lr * float(self.multiplier(epoch))
        _set_lr(self.model.optimizer, lr)
        if self.verbose and C.rank() == 0 and self.staircase:
            print(f"\nEpoch {int(epoch) + 1}: LearningRateScheduleCallback set the learning rate "
                  f"to {lr:g}.")

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.steps_per_epoch is None:
            steps = (self.params or {}).get("steps")
            if not self.staircase and not steps:
                raise ValueError("LearningRateScheduleCallback with staircase=False needs "
                                 "steps_per_epoch (the number of batches per epoch) when fit() "
                                 "cannot tell it")
            self.steps_per_epoch = steps

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        if not self.staircase and self._active(self.current_epoch):
            self._adjust(self.current_epoch + batch / float(self.steps_per_epoch))

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            lr = self.model.optimizer.learning_rate
            logs["lr"] = float(lr.numpy() if hasattr(lr, "numpy") else lr)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the first
    ``warmup_epochs`` epochs, batch by batch (Goyal et al., "Accurate, Large Minibatch SGD"):
    ``lr(e) = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)`` at fractional epoch e.
    ``initial_lr`` is the scaled rate the training reaches (e.g. ``0.1 * hvd.size()``).
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int) or warmup_epochs < 1:
            raise ValueError(f"warmup_epochs must be an int >= 1, got {warmup_epochs!r}")

        def multiplier(epoch: float) -> float:
            n = C.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1:
            # the ramp stops one batch short of its end value: land on initial_lr exactly
            _set_lr(self.model.optimizer, self.initial_lr)
            if self.verbose and C.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                      f"{self.initial_lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` with ``save_best_only=True`` that writes on rank 0
    only (other ranks track the same best value, so pair it with MetricAverageCallback)."""

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0,
                 mode: str = "auto", save_weights_only: bool = False, save_freq: Any = "epoch"):
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def _save_model(self, epoch: int, batch: Optional[int], logs: Optional[dict]) -> None:
        if C.rank() == 0:
            super()._save_model(epoch, batch, logs)
        elif hasattr(self, "_should_save_model"):   # Keras 3: track the best value, write nothing
            self._should_save_model(epoch, batch, logs or {}, self._get_file_path(epoch, batch, logs))
        else:   # Keras 2: the same by hand
            current = (logs or {}).get(self.monitor)
            if current is not None and self.monitor_op(current, self.best):
                self.best = current
