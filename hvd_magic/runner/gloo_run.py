"""``hvdrun --gloo``: start the ranks with no MPI at all (Horovod's ``horovodrun --gloo``).

hvdrun starts every rank itself, with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) and Horovod's (``HOROVOD_RANK``, ...), so ``hvd.init()`` chooses the gloo
controller (:mod:`hvd_magic.collectives.controller`). On one host hvdrun keeps the
rendezvous store at a port the system picks and the ranks meet on 127.0.0.1. With ``-H`` or
``--hostfile`` naming other hosts, each rank starts under :mod:`.gloo_nanny` on its host
(through the ssh agent, as :mod:`.gloo_plan` plans it) and the ranks meet at the first host.
The ranks' output passes through a whole line at a time, as under ``mpiexec``; when a rank
fails (nonzero exit, a signal, or a lost connection) the others are stopped, on every host,
and hvdrun names it (and its host) and exits with its status.
"""
from __future__ import annotations

import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import (BinaryIO, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional,
                    Sequence, TextIO)

from .. import config
from .gloo_nanny import EXIT_MARK
from .gloo_plan import RankStart, exit_text, hosts_text, place, plan_hosts
from .launch import handling, local_names
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
    """ValueError for what ``--gloo`` does not do."""
    if args.min_np is not None or args.max_np is not None or args.host_discovery_script:
        raise ValueError("elastic training (--min-np, --max-np, --host-discovery-script) needs "
                         "MPI: leave out --gloo")


def run(args: LaunchArgs, env: Optional[Mapping[str, str]] = None) -> int:
    """Start ``args.np`` ranks of ``args.command`` (here, or on ``args.hosts``) and wait for
    them; the job's exit code (128+N when a rank was killed by signal N)."""
    check(args)
    base = dict(os.environ if env is None else env)
    # this machine's names, and the hosts given by one of its addresses: their ranks start
    # here directly, not through ssh
    names = local_names() | {h.name for h in args.hosts or [] if is_this_machine(h.name)}
    if not is_single_host(args, names):
        return run_hosts(args, base, names)
    base.update(horovod_env(args))
    base.update(args.extra_env)
    store = rendezvous_store(args.np)
    envs = rank_envs(args.np, base, "127.0.0.1", store.port)
    if args.verbose:
        sys.stderr.write(f"hvdrun --gloo: {args.np} ranks of {' '.join(args.command)} "
                         f"(rendezvous 127.0.0.1:{store.port})\n")
    return supervise(args.command, envs)


def rendezvous_store(np: int, loopback: bool = True):
    """The ranks' rendezvous store, kept by hvdrun (as torchrun's agent keeps its own) at a
    port the system picks: it outlives every rank, so no rank's exit closes it under the
    others. ``loopback``: one host, the store listens on 127.0.0.1 only (torch's own
    listens on every interface, so hvdrun binds the socket and hands it over); else on
    every interface, where the ranks on other hosts reach it at the first host's address."""
    import datetime
    import socket

    from torch.distributed import TCPStore
    timeout = datetime.timedelta(seconds=config.get("HVD_MAGIC_TORCH_INIT_TIMEOUT"))
    if not loopback:
        return TCPStore("127.0.0.1", 0, np + 1, is_master=True, wait_for_workers=False,
                        timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return TCPStore("127.0.0.1", port, np + 1, is_master=True, wait_for_workers=False,
                    timeout=timeout, master_listen_fd=sock.detach())   # (the store's now)


def supervise(command: Sequence[str], envs: List[Dict[str, str]],
              timeout: Optional[float] = None) -> int:
    """Run one process of ``command`` per environment (each in a session of its own) until
    all end; the first to fail stops the others. Each rank's output reaches hvdrun's
    stdout and stderr a whole line at a time, so two ranks' lines never mix mid-line (with
    ``PYTHONUNBUFFERED`` a print writes its text and its newline separately). SIGINT/SIGTERM
    to hvdrun go to every rank."""
    procs: List[subprocess.Popen] = []
    stopping: List[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    ended: "queue.Queue[tuple]" = queue.Queue()     # (rank, exit code) in the order they end
    pumps: List[threading.Thread] = []
    with handling({signal.SIGINT: forward, signal.SIGTERM: forward}):
        try:
            for r, env in enumerate(envs):
                p = subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
                procs.append(p)
                for src, dst in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                    pumps.append(threading.Thread(target=_pump, args=(src, dst), daemon=True))
                    pumps[-1].start()
                threading.Thread(target=lambda r=r, p=p: ended.put((r, p.wait())),
                                 daemon=True).start()
            worst = 0
            for r, c in _endings(ended, len(procs), timeout, lambda: _stop_all(procs)):
                if c != 0 and not stopping and worst == 0:
                    what = f"was killed by signal {-c}" if c < 0 else f"exited with status {c}"
                    sys.stderr.write(f"hvdrun: rank {r} (pid {procs[r].pid}) {what}; stopping "
                                     "the other ranks\n")
                    sys.stderr.flush()
                    _stop_all(procs)
                if c != 0 and worst == 0:
                    worst = 128 - c if c < 0 else c
            return worst
        except BaseException:
            _stop_all(procs)
            raise
        finally:
            # the ranks' last lines (a process a rank left behind may hold its pipe open:
            # do not wait for it)
            end = time.monotonic() + 2.0
            for t in pumps:
                t.join(max(0.0, end - time.monotonic()))


def _endings(ended: "queue.Queue", count: int, timeout: Optional[float],
             stop: Callable[[], None]) -> Iterator:
    """The first ``count`` items of ``ended`` (one per rank, as each ends); past ``timeout``
    seconds, ``stop()`` the job and raise TimeoutError."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for _ in range(count):
        while True:
            try:
                item = ended.get(timeout=1.0)
                break
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    stop()
                    raise TimeoutError(f"the job ran past timeout={timeout:g} s and was stopped")
        yield item


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


# ---------------------------------------------------------------------------- several hosts
def is_this_machine(name: str) -> bool:
    """Whether ``name`` is an address of this machine (one of its addresses can be bound)."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0) + tuple(sockaddr[2:]))
            return True
        except OSError:
            continue
    return False


def free_port() -> int:
    """A port free here now (for a rendezvous on another host: the best guess there is)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_hosts(args: LaunchArgs, base: Mapping[str, str], names: FrozenSet[str],
              timeout: Optional[float] = None) -> int:
    """``hvdrun --gloo -H ...``: every rank under :mod:`.gloo_nanny`, on this machine or
    through the ssh agent (:func:`.gloo_plan.plan_hosts`); the ranks meet at the first
    host. ``names``: the hosts' names that mean this machine. When the first host is this
    machine hvdrun keeps the rendezvous store there (it outlives every rank), else rank 0
    keeps it at a port that is free here."""
    first = place(args.hosts or [], args.np)[0].host
    store = rendezvous_store(args.np, loopback=False) if first in names else None
    port = store.port if store is not None else free_port()
    starts = plan_hosts(args, base, cwd=os.getcwd(), port=port, store_here=store is not None,
                        local_names=names)
    if args.verbose:
        sys.stderr.write(f"hvdrun --gloo: {args.np} ranks of {' '.join(args.command)} on "
                         f"{hosts_text(starts)} (rendezvous {first}:{port}, the store kept "
                         f"by {'hvdrun' if store is not None else 'rank 0'})\n")
        for s in starts:
            sys.stderr.write(f"hvdrun --gloo: rank {s.place.rank}: "
                             f"{' '.join(shlex.quote(a) for a in s.argv)}\n")
        sys.stderr.flush()
    return supervise_hosts(starts, timeout)


class _Rank:
    """One started rank: its process here (the nanny, or the agent that reaches it) and
    how it ended (``status`` as the nanny reported it; None: no report)."""

    def __init__(self, start: RankStart, proc: subprocess.Popen) -> None:
        self.start, self.proc = start, proc
        self.status: Optional[int] = None
        self.reported = threading.Event()

    def ask(self, text: Optional[str]) -> None:
        """Send the nanny a line (a signal number), or end its input (None: stop the rank)."""
        try:
            if text is None:
                self.proc.stdin.close()
            else:
                self.proc.stdin.write(text.encode() + b"\n")
                self.proc.stdin.flush()
        except (OSError, ValueError, RuntimeError):   # the connection is gone already (or
            pass                                      # a signal came in mid-write: it stops all)


#: One rank's line at a time on hvdrun's stdout and stderr (the pumps run in threads).
_WRITING = threading.Lock()


def _write(stream: TextIO, data: bytes) -> None:
    """``data`` as it came (bytes, when the stream has a buffer), whole, then flushed."""
    with _WRITING:
        buffer = getattr(stream, "buffer", None)
        stream.flush()
        if buffer is not None:
            buffer.write(data)
            buffer.flush()
        else:
            stream.write(data.decode(errors="replace"))
            stream.flush()


def _pump_stdout(rank: _Rank, ended: "queue.Queue[int]") -> None:
    """The rank's stdout to ours, but the nanny's exit line, which says how it ended."""
    mark = f"{EXIT_MARK} status=".encode()
    for line in iter(rank.proc.stdout.readline, b""):
        before, found, after = line.partition(mark)
        if found and after.strip().lstrip(b"-").isdigit() and not rank.reported.is_set():
            rank.status = int(after.strip())
            rank.reported.set()
            ended.put(rank.start.place.rank)
            line = before + b"\n" if before else b""
        if line:
            _write(sys.stdout, line)
    if not rank.reported.is_set():
        rank.reported.set()
        ended.put(rank.start.place.rank)


def _pump(src: BinaryIO, dst: TextIO) -> None:
    """A rank's output to ours, a whole line at a time."""
    for line in iter(src.readline, b""):
        _write(dst, line)


def supervise_hosts(starts: Sequence[RankStart], timeout: Optional[float] = None) -> int:
    """Start every rank of ``starts`` and watch them until all have ended; the first that
    fails (or is lost) ends the job: hvdrun names it and its host and stops the others on
    every host. SIGINT/SIGTERM to hvdrun go to every rank."""
    ranks: List[_Rank] = []
    stopping: List[int] = []
    ended: "queue.Queue[int]" = queue.Queue()

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for r in ranks:
            r.ask(str(signum))

    with handling({signal.SIGINT: forward, signal.SIGTERM: forward}):
        try:
            for s in starts:
                proc = subprocess.Popen(s.argv, env=s.env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
                rank = _Rank(s, proc)
                ranks.append(rank)
                threading.Thread(target=_pump_stdout, args=(rank, ended), daemon=True).start()
                threading.Thread(target=_pump, args=(proc.stderr, sys.stderr), daemon=True).start()
            worst = 0
            for r in _endings(ended, len(ranks), timeout, lambda: _stop_ranks(ranks)):
                rank = ranks[r]
                if rank.status == 0:
                    continue
                agent = None
                if rank.status is None:
                    try:
                        agent = rank.proc.wait(2.0)
                    except subprocess.TimeoutExpired:
                        pass
                what, code = exit_text(rank.status, agent)
                if not stopping and worst == 0:
                    sys.stderr.write(f"hvdrun: rank {r} on {rank.start.place.host} {what}; "
                                     "stopping the other ranks\n")
                    sys.stderr.flush()
                    _stop_ranks(ranks)
                if worst == 0:
                    worst = code
            return worst
        except BaseException:
            _stop_ranks(ranks)
            raise
        finally:
            for rank in ranks:
                _reap(rank.proc)


def _stop_ranks(ranks: List[_Rank]) -> None:
    """End every rank's input (its nanny stops it: SIGTERM, then SIGKILL after its grace);
    a rank that has not reported within ``GRACE_S`` + 10 s more loses its connection (the
    agent here is killed), which a nanny takes as the same request."""
    for r in ranks:
        r.ask(None)
    end = time.monotonic() + GRACE_S + 10.0
    for r in ranks:
        if not r.reported.wait(max(0.1, end - time.monotonic())):
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _reap(proc: subprocess.Popen) -> None:
    """Collect the process started here (a nanny, or an agent); kill it if it lingers."""
    try:
        proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
