"""One rank of a :class:`~hvd_magic.ray.RayExecutor` job: a Ray actor (runs in the worker
process Ray starts for it, on whichever node its placement-group bundle landed).

The executor asks each worker where it runs (:meth:`BaseHorovodWorker.node`), gives it
torchrun's variables (:meth:`update_env_vars`), so that ``hvd.init()`` in the user's
function finds its rank, size, local rank and rendezvous address exactly as under
``torchrun``, and then runs functions on it; the process stays alive between calls, so
state (``hvd.init()``, a model) carries over from one ``run`` to the next.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Callable, Dict, List, Optional


class BaseHorovodWorker:
    """A worker's state: its environment and the optional ``executable_cls`` instance
    that :meth:`RayExecutor.execute` hands to its functions (Horovod's name)."""

    executable: Any = None

    def node(self) -> Dict[str, Any]:
        """Where this worker runs: Ray's node id and address, the hostname, the pid, and
        the GPUs Ray gave it."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        """A TCP port free on this node now (for rank 0's rendezvous, as torchrun picks one)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def update_env_vars(self, env_vars: Dict[str, Any]) -> None:
        """Set environment variables in this worker's process (values as strings)."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def start_executable(self, executable_cls: Optional[type] = None,
                         executable_args: Optional[List] = None,
                         executable_kwargs: Optional[Dict] = None) -> None:
        """Create the object :meth:`execute` passes to its functions (None without a class)."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []),
                                             **(executable_kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` in this worker."""
        return fn(self.executable)

    def run(self, fn: Callable[..., Any], args: Optional[List] = None,
            kwargs: Optional[Dict] = None) -> Any:
        """``fn(*args, **kwargs)`` in this worker."""
        return fn(*(args or []), **(kwargs or {}))
