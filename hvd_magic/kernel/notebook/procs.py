"""Runs in the notebook kernel.

Process plumbing for the pool: start a child that dies with this kernel, stop a process
tree completely, and read how ranks ended from ``mpiexec``'s log.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:  # noqa: BLE001 - best effort; atexit still stops the pool
        pass


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: str) -> subprocess.Popen:
    """Start ``argv`` in a process group of its own, output to ``log_path`` (mode 0600).

    Its own group: a signal to the kernel's group (Jupyter's interrupt) does not reach it,
    and ``stop_tree`` can signal all of it. The kernel's session, not a new one: Linux
    shares the CPU between sessions (scheduler autogroups) before it weighs the threads
    inside them, so in a session of its own the pool's ranks would lose a core to any
    kernel thread that wakes, the live panel's low-priority redraw included, at a whole
    session's weight (benchmarks/widgets.py measures what that costs). On Linux, from the
    main thread, the child gets SIGTERM when this process dies, so a kernel killed with
    SIGKILL still takes its pool down.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        pdeath = (threading.current_thread() is threading.main_thread()
                  and os.uname().sysname == "Linux")
        return subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=fd,
                                stderr=fd, process_group=0,
                                preexec_fn=_die_with_parent if pdeath else None)
    finally:
        os.close(fd)


def descendants(pid: int) -> List["object"]:
    """psutil.Process objects of ``pid`` and everything below it (empty if it is gone)."""
    import psutil
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            try:
                proc.send_signal(sig)
            except OSError:
                pass


def stop_tree(term: Sequence[Optional[subprocess.Popen]],
              kill: Sequence[Optional[subprocess.Popen]], known: Iterable["object"],
              grace: float = 2.0) -> None:
    """Stop process trees fast and completely.

    ``term`` (mpiexec) gets SIGTERM so it can clean up, SIGKILL after ``grace`` s; ``kill``
    (the controller and its schedulers) and every process below either, plus ``known``
    (psutil.Process objects recorded earlier: engines and their nannies, which ipyparallel
    starts in sessions of their own), get SIGKILL at once.
    """
    import psutil
    term = [p for p in term if p is not None]
    kill = [p for p in kill if p is not None]
    tops = {p.pid for p in term + kill}
    tracked: Dict[int, object] = {}
    for p in list(known):
        tracked[p.pid] = p
    for p in term + kill:
        for d in descendants(p.pid):
            tracked.setdefault(d.pid, d)
    for p in term:
        _signal_group(p, signal.SIGTERM)
    for p in kill:
        _signal_group(p, signal.SIGKILL)
    victims = []
    for pid, proc in tracked.items():
        if pid in tops:
            continue
        try:
            if not _gone(proc):
                proc.kill()  # type: ignore[attr-defined]
                victims.append(proc)
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace
    for p in term + kill:
        try:
            p.wait(max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait(2)
    wait_until(lambda: all(_gone(v) for v in victims), 2.0)


def end_job_first(mpiexec: Optional[subprocess.Popen], client: Any, controller: Any,
                  grace: float = 3.0) -> None:
    """Multi-host pools: let ``mpiexec`` end the ranks on every host while the controller
    still runs. The nanny of a rank on another host (out of this machine's reach) tells the
    controller that its engine ended and exits at once; with the controller already gone it
    lingered about 3 s before giving up."""
    if mpiexec is None or mpiexec.poll() is not None:
        return
    try:
        mpiexec.send_signal(signal.SIGTERM)
        mpiexec.wait(grace)
    except Exception:  # noqa: BLE001 - still running: stop_tree kills it
        return
    if client is not None and controller is not None:
        wait_until(lambda: not client.ids or controller.poll() is not None, 1.0)


def _gone(proc: "object") -> bool:
    """Exited (a zombie counts: its parent, often init, reaps it, not us)."""
    import psutil
    try:
        return (not proc.is_running()  # type: ignore[attr-defined]
                or proc.status() == psutil.STATUS_ZOMBIE)  # type: ignore[attr-defined]
    except psutil.Error:
        return True


def pids_gone(pids: Sequence[Optional[int]]) -> bool:
    """Whether every one of these local processes has exited (None: unknown, so not gone)."""
    import psutil
    for pid in pids:
        if pid is None:
            return False
        try:
            if not _gone(psutil.Process(pid)):
                return False
        except psutil.NoSuchProcess:
            continue
    return True


@dataclass(frozen=True)
class RankExit:
    """How a rank ended, as ``mpiexec`` reported it."""

    rank: int
    how: str            # "killed by signal 9 (Killed)", "exited with code 3", ...


_SIGNAL_RE = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal "
                        r"(\d+) \(([^)]*)\)")
_IMPROPER_RE = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exiting improperly")
_EXIT_RE = re.compile(r"Process name: \[[^\]]*,(\d+)\] Exit code: (-?\d+)")
_MPICH_RE = re.compile(r"rank (\d+) PID \d+ RUNNING AT (\S+) EXIT CODE: (\d+)")


def parse_rank_exits(log: str) -> List[RankExit]:
    """Ranks that ended abnormally according to Open MPI's (or MPICH's) messages in ``log``."""
    text = " ".join(log.split())
    out: Dict[int, RankExit] = {}
    for m in _SIGNAL_RE.finditer(text):
        rank, host, num, name = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        out.setdefault(rank, RankExit(rank, f"killed by signal {num} ({name}) on {host}"))
    for m in _IMPROPER_RE.finditer(text):
        rank = int(m.group(1))
        out.setdefault(rank, RankExit(rank, f"exited without MPI_Finalize (os._exit or a "
                                            f"crash) on {m.group(2)}"))
    for m in _EXIT_RE.finditer(text):
        rank = int(m.group(1))
        out.setdefault(rank, RankExit(rank, f"exited with code {m.group(2)}"))
    for m in _MPICH_RE.finditer(text):
        rank, code = int(m.group(1)), int(m.group(3))
        how = (f"killed by signal {code - 128}" if code > 128 else f"exited with code {code}")
        out.setdefault(rank, RankExit(rank, f"{how} on {m.group(2)}"))
    return [out[r] for r in sorted(out)]


def tail(path: str, limit: int = 4000) -> str:
    """The last ``limit`` characters of a log file ('' if unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def wait_until(pred, timeout: float, step: float = 0.01) -> bool:
    """Poll ``pred()`` until true or ``timeout`` s pass; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


def describe_exit(code: Optional[int]) -> str:
    """``mpiexec``'s own exit status in words."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
