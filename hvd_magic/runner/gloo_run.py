"""``hvdrun --gloo``: start the ranks with no MPI at all (Horovod's ``horovodrun --gloo``).

hvdrun starts every rank itself, with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and Horovod's (``HOROVOD_RANK``, ...), so ``hvd.init()`` chooses the gloo
controller (:mod:`hvd_magic.collectives.controller`); hvdrun itself keeps the rendezvous
store, on 127.0.0.1 at a port the system picks. The ranks' output passes
through, as under ``mpiexec``; when a rank fails (nonzero exit or a signal) the others are
stopped and hvdrun names it and exits with its status.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence

from .. import config
from .plan import LaunchArgs, horovod_env, is_single_host

#: Seconds a rank may take to end after SIGTERM before it is killed.
GRACE_S = 5.0


def rank_envs(np: int, base: Mapping[str, str], addr: str, port: int) -> List[Dict[str, str]]:
    """Every rank's environment on one host: ``base`` plus the launcher's variables (no MPI
    launcher's: the ranks must find no MPI world)."""
    clean = {k: v for k, v in base.items()
             if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_"))}
    out = []
    for r in range(np):
        env = dict(clean)
        env.update({"RANK": str(r), "WORLD_SIZE": str(np), "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(np), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                    "MASTER_ADDR": addr, "MASTER_PORT": str(port),
                    "HOROVOD_RANK": str(r), "HOROVOD_SIZE": str(np),
                    "HOROVOD_LOCAL_RANK": str(r), "HOROVOD_LOCAL_SIZE": str(np),
                    "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
                    "HOROVOD_CONTROLLER": "gloo", "HOROVOD_HOSTNAME": socket.gethostname(),
                    # the store is hvdrun's (:func:`rendezvous_store`); rank 0 keeps none
                    "TORCHELASTIC_USE_AGENT_STORE": "True"})
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")     # (one host: gloo on loopback)
        env.setdefault("PYTHONUNBUFFERED", "1")
        out.append(env)
    return out


def check(args: LaunchArgs) -> None:
    """ValueError for what ``--gloo`` does not do (yet)."""
    if args.hosts is not None and not is_single_host(args):
        raise ValueError("--gloo runs the ranks on this host only; on several hosts run "
                         "`torchrun --nnodes N --node-rank I --rdzv-endpoint HOST:PORT "
                         "--nproc-per-node K train.py` on each host (the same gloo controller), "
                         "or hvdrun without --gloo (MPI)")
    if args.min_np is not None or args.max_np is not None or args.host_discovery_script:
        raise ValueError("elastic training (--min-np, --max-np, --host-discovery-script) needs "
                         "MPI: leave out --gloo")
    if args.hostfile is not None:
        raise ValueError("--hostfile needs MPI (several hosts): leave out --gloo")


def run(args: LaunchArgs, env: Optional[Mapping[str, str]] = None) -> int:
    """Start ``args.np`` ranks of ``args.command`` here and wait for them; the job's exit
    code (128+N when a rank was killed by signal N)."""
    check(args)
    base = dict(os.environ if env is None else env)
    base.update(horovod_env(args))
    base.update(args.extra_env)
    store = rendezvous_store(args.np)
    envs = rank_envs(args.np, base, "127.0.0.1", store.port)
    if args.verbose:
        sys.stderr.write(f"hvdrun --gloo: {args.np} ranks of {' '.join(args.command)} "
                         f"(rendezvous 127.0.0.1:{store.port})\n")
    return supervise(args.command, envs)


def rendezvous_store(np: int):
    """The ranks' rendezvous store, kept by hvdrun (as torchrun's agent keeps its own) on
    127.0.0.1 at a port the system picks: it outlives every rank, so no rank's exit
    closes it under the others."""
    import datetime

    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", 0, np + 1, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=config.get("HVD_MAGIC_TORCH_INIT_TIMEOUT")))


def supervise(command: Sequence[str], envs: List[Dict[str, str]],
              timeout: Optional[float] = None) -> int:
    """Run one process of ``command`` per environment (each in a session of its own, its
    output inherited) until all end; the first to fail stops the others. SIGINT/SIGTERM
    to hvdrun go to every rank."""
    procs: List[subprocess.Popen] = []
    previous: Dict[int, object] = {}
    stopping: List[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
    ended: "queue.Queue[tuple]" = queue.Queue()     # (rank, exit code) in the order they end
    try:
        for r, env in enumerate(envs):
            p = subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
            procs.append(p)
            threading.Thread(target=lambda r=r, p=p: ended.put((r, p.wait())),
                             daemon=True).start()
        deadline = None if timeout is None else time.monotonic() + timeout
        left, worst = len(procs), 0
        while left:
            try:
                r, c = ended.get(timeout=1.0)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    _stop_all(procs)
                    raise TimeoutError(f"the job ran past timeout={timeout:g} s and was stopped")
                continue
            left -= 1
            if c != 0 and not stopping and worst == 0:
                what = f"was killed by signal {-c}" if c < 0 else f"exited with status {c}"
                sys.stderr.write(f"hvdrun: rank {r} (pid {procs[r].pid}) {what}; stopping the "
                                 f"other ranks\n")
                sys.stderr.flush()
                _stop_all(procs)
            if c != 0 and worst == 0:
                worst = 128 - c if c < 0 else c
        return worst
    except BaseException:
        _stop_all(procs)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _stop_all(procs: List[subprocess.Popen]) -> None:
    """SIGTERM every rank still running (its whole session), SIGKILL after ``GRACE_S``."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)
