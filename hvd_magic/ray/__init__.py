"""Horovod's ``horovod.ray`` on hvd_magic: :class:`RayExecutor` runs a function on Ray
actors, one rank each, that ``hvd.init()`` joins over torch.distributed (see
:mod:`hvd_magic.ray.runner`). A launcher like :mod:`hvd_magic.runner`: nothing in
hvd_magic imports it.
"""
from .runner import MiniSettings, RayExecutor, RayWorkerError
from .worker import BaseHorovodWorker

__all__ = ["BaseHorovodWorker", "MiniSettings", "RayExecutor", "RayWorkerError"]
