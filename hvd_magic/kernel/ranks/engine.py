"""Runs in each rank (a pool engine, one MPI process per rank).

Entry point of one pool engine (``python -m hvd_magic.kernel.ranks.engine``), started by mpiexec.

Before ipyparallel's engine starts: the umask becomes 077 and, where GPUs exist, this rank
is given its own (``CUDA_VISIBLE_DEVICES`` by local rank, see :func:`gpu_for_local_rank`).
Then ``hvd.init()`` runs (:func:`hvd_magic.kernel.ranks.calls.startup`, overlapping the
controller's start), and the engine registers with MPI rank = engine id.
"""
from __future__ import annotations

import glob
import os
import sys
from typing import List, Mapping, Optional

STARTUP = "__import__('hvd_magic.kernel.ranks.calls').kernel.ranks.calls.startup()"

ENGINE_ARGS = ["--mpi", "--log-level=WARN", f"--IPEngine.startup_command={STARTUP}",
               "--IPEngine.mpi_registration_delay=0"]

_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK",
                    "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def local_rank_from_env(env: Mapping[str, str]) -> Optional[int]:
    """This process's rank among the ranks on its host, as the MPI launcher tells it."""
    for name in _LOCAL_RANK_VARS:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def gpu_for_local_rank(env: Mapping[str, str], gpu_count: int) -> Optional[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value for this rank, or None to leave it alone.

    Each local rank gets one device: the ``local_rank``-th of an existing
    ``CUDA_VISIBLE_DEVICES`` list, else device ``local_rank % gpu_count``. Nothing changes
    without GPUs, without a local rank, or with ``HVD_MAGIC_PIN_GPU=0``.
    """
    from ... import config
    if not config.get("HVD_MAGIC_PIN_GPU", env):
        return None
    local = local_rank_from_env(env)
    if local is None:
        return None
    listed = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if listed:
        return listed[local % len(listed)].strip()
    if gpu_count <= 0:
        return None
    return str(local % gpu_count)


def count_gpus() -> int:
    """NVIDIA devices visible as ``/dev/nvidiaN`` (no CUDA import)."""
    return len([p for p in glob.glob("/dev/nvidia[0-9]*") if p[len("/dev/nvidia"):].isdigit()])


def _die_with_launcher() -> None:
    """SIGKILL this engine when the MPI launcher that started it dies (Linux), so a pool
    whose mpiexec is killed leaves no engine behind."""
    try:
        import ctypes
        import ctypes.util
        import signal
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
        if os.getppid() == 1:                   # the launcher is already gone
            os._exit(1)
    except Exception:  # noqa: BLE001 - best effort; the pool's stop() kills engines anyway
        pass


def main(argv: Optional[List[str]] = None) -> None:
    """Pin the GPU, then run ipyparallel's engine app."""
    os.umask(0o077)
    if sys.platform.startswith("linux"):
        _die_with_launcher()
    import signal
    # a Ray worker's child inherits SIGINT blocked (and may inherit it ignored): an
    # interrupt must raise KeyboardInterrupt in the running cell, as in any Python process
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    gpu = gpu_for_local_rank(os.environ, count_gpus())
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    # hvd.init() (numpy, mpi4py, MPI_Init, communicators) now, while the controller is
    # still starting, rather than after registration where it would delay the heartbeat
    from . import calls
    calls.startup()
    args = list(sys.argv[1:] if argv is None else argv)
    # an engine that %hvd resize spawned asks for no id (``--mpi`` would ask for its rank in
    # the spawned group, an id another engine has or had): the controller's next id is new;
    # an engine given its id (a rank of a Ray pool, which has no MPI world) asks MPI for none
    no_mpi = any(a.startswith("--IPEngine.id=") for a in args) or calls.joined()
    sys.argv = [sys.argv[0]] + [a for a in ENGINE_ARGS if not (no_mpi and a == "--mpi")] + args
    from ipyparallel.engine.app import main as engine_main
    try:
        engine_main()
    except RuntimeError as exc:
        # ipyparallel's engine ends this way when it is asked to shut down (the kernel
        # stops the loop that waits for the engine's end): a clean exit, not a failure
        if "Event loop stopped before Future completed" not in str(exc):
            raise


if __name__ == "__main__":
    main()
