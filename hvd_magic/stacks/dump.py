"""Doing: each rank answers a signal with every thread's stack; a gatherer collects them.

:func:`install` (at ``hvd.init()``) makes a rank answer two signals, writing every thread's
Python stack (:func:`faulthandler.dump_traceback`'s format) to ``<dir>/<rank>.stack``; it
records its pid, host and main thread in ``<dir>/<rank>.pid``:

- :data:`SIGNAL` (SIGUSR2) with a Python handler. It runs in the main thread with the GIL,
  so every other thread is between two steps of its code while the stacks are read. The
  main thread runs it at once when it waits in hvd_magic, sleeps, or runs Python code.
- :data:`SIGNAL_HELD` (a real-time signal), sent by :func:`gather` to a rank that did not
  answer the first within :data:`ANSWER_S`, with :mod:`faulthandler`'s handler, which
  reads the stacks from C without the GIL: a rank stuck in C code holding the GIL still
  answers. Not first: reading the stacks of threads that run meanwhile can crash the rank
  (it did, one dump in a few, while the engine thread polled).

The directory is ``HVD_MAGIC_STACKS_DIR`` (set by hvdrun and by a notebook's pool), else
one per MPI job under the temporary directory. :func:`gather` signals every rank that runs
on this host and reads what each wrote, for at most ``timeout`` seconds; a rank that does
not answer, or runs on another host, is named as such. A rank whose host lacks that
directory answers on its stderr, each line marked (:data:`FRAME`): hvdrun takes those lines
out of the job's output (:class:`Framed`), a notebook's pool out of its ``mpiexec`` log
(:func:`answers_in`). Such a rank also starts a :mod:`.watch` process, which sends it
SIGNAL_HELD when it hears SIGNAL and no answer follows (``mpiexec`` forwards SIGNAL only).
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

from .. import config
from .group import RankStack, is_user_file, parse

#: At most this many tensor names keep the line that first submitted them.
SITES_CAP = 4096

#: The signal a rank answers with its stacks (Open MPI's mpiexec forwards it to the ranks).
SIGNAL = signal.SIGUSR2
#: The signal a rank answers from C, without the GIL (None where there are no real-time
#: signals).
SIGNAL_HELD = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None
#: How a rank on another host than hvdrun's marks each line of its stacks on stderr; the
#: last line (after the mark) is END.
FRAME = "[hvd_magic stacks of rank {rank}] "
END = "end of stacks: pid {pid} host {host} main {main}"
_FRAMED = re.compile(r"\[hvd_magic stacks of rank (\d+)\] (.*)$")
_END = re.compile(r"end of stacks: pid (\d+) host (\S+) main (\d+)$")
#: What the Python handler of a rank with a :mod:`.watch` process writes into Python's signal
#: wake-up pipe once it has answered (signal numbers are below it).
ANSWERED = 0xFF


#: Seconds :func:`gather` waits for a rank's answer to SIGNAL before it sends SIGNAL_HELD.
ANSWER_S = 0.5
#: Seconds a gatherer waits for the ranks' stacks.
TIMEOUT = 2.0
#: A dump is complete when its file has not grown for this long.
SETTLE_S = 0.1

_state: Dict[str, object] = {}


#: Open MPI's job namespace: ``prterun-<launcher's host>-<launcher's pid>_<job>``.
_PRTE_JOB = re.compile(r"prterun-(.+)-(\d+)_\d+$")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def stale_job_dirs(names: Sequence[str], uid: int, host: str, alive) -> List[str]:
    """Deciding: which of ``names`` (entries of the temporary directory) are this user's
    job directories left by ranks killed with SIGKILL (which cannot remove their files):
    those of Open MPI jobs whose launcher ran on ``host`` and is gone (``alive(pid)``
    False). A directory of a job started on another host is left alone.

    >>> stale_job_dirs(["hvd_magic-stacks-0-prterun-vm-17_1", "hvd_magic-stacks-0-prterun-vm-18_1",
    ...                 "hvd_magic-stacks-0-prterun-pc2-17_1", "hvd_magic-stacks-1-prterun-vm-17_1"],
    ...                0, "vm", lambda pid: pid == 18)
    ['hvd_magic-stacks-0-prterun-vm-17_1']
    """
    prefix = f"hvd_magic-stacks-{uid}-"
    out = []
    for name in names:
        m = _PRTE_JOB.match(name[len(prefix):]) if name.startswith(prefix) else None
        if m and m.group(1) == _safe(host) and not alive(int(m.group(2))):
            out.append(name)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass            # another user's process
    return True


def _remove_stale(base: str, uid: int) -> None:
    """Doing: remove :func:`stale_job_dirs` of ``base``."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in stale_job_dirs(names, uid, socket.gethostname(), _alive):
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def job_dir(env: Optional[dict] = None) -> Optional[str]:
    """Where this job's ranks write their stacks (None: nowhere known)."""
    env = os.environ if env is None else env
    given = config.get("HVD_MAGIC_STACKS_DIR", env)
    if given:
        return given
    # one directory per MPI job, named by the launcher's job id
    job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_orte_ess_jobid") or env.get("PMI_KVSNAME")
    if not job:
        return None
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"hvd_magic-stacks-{uid}-{_safe(job)}")


def install(rank: int) -> Optional[str]:
    """Make this process answer :data:`SIGNAL` with every thread's stack, as ``rank``.
    Returns the stack file, or None (no directory known, or the program handles the
    signal itself: then it is left alone)."""
    current = signal.getsignal(SIGNAL)
    if current is not _answer and (callable(current) or current == signal.SIG_IGN):
        return None      # the program's own handler
    d = job_dir()
    if d is None:
        return None
    given = bool(config.get("HVD_MAGIC_STACKS_DIR"))
    try:
        if not given:
            os.makedirs(d, mode=0o700, exist_ok=True)
            owner = os.stat(d).st_uid
            if hasattr(os, "getuid") and owner != os.getuid():
                return None      # someone else's directory of that name: not ours to use
            if not _state.get("cleanup"):
                # nobody else removes a directory the ranks made: each rank takes its files
                # away at exit, and the last one the directory; those of killed jobs are
                # removed by the ranks of a later job
                _state["cleanup"] = True
                atexit.register(_remove_own, d)
                _remove_stale(os.path.dirname(d), owner)
        elif not os.path.isdir(d):
            # hvdrun's directory is on its own host: a rank elsewhere answers on stderr,
            # each line marked, and hvdrun takes its stacks out of the job's output (Framed)
            _state["rank"] = rank
            _answer_to(_stderr(), framed=True)
            _start_watcher(rank)
            return None
        path = os.path.join(d, f"{rank}.stack")
        if _state.get("path") != path:
            old = _state.get("file")
            _answer_to(open(path, "ab", buffering=0))
            _state["path"] = path
            if old is not None and old is not _stderr():
                old.close()  # type: ignore[attr-defined]
        tmp = os.path.join(d, f".{rank}.pid.{os.getpid()}")
        with open(tmp, "w") as fh:
            fh.write(f"{os.getpid()} {socket.gethostname()} {threading.main_thread().ident}\n")
        os.replace(tmp, os.path.join(d, f"{rank}.pid"))
    except OSError:
        return None
    return path


def _answer_to(fh, framed: bool = False) -> None:
    """Answer both signals by writing to ``fh`` (``framed``: each line marked with this
    rank, the Python handler's answer only)."""
    _state["file"] = fh
    _state["framed"] = framed
    try:
        signal.signal(SIGNAL, _answer)
    except ValueError:     # not the main thread: only C's handler can answer
        faulthandler.register(SIGNAL, file=fh, all_threads=True, chain=False)
    if SIGNAL_HELD is not None:
        faulthandler.register(SIGNAL_HELD, file=fh, all_threads=True, chain=False)


#: Seconds a watcher has to end once its pipe is closed (it may still be starting: a
#: Python start takes seconds on a loaded machine) before it is killed.
WATCHER_STOP_S = 5.0


def _start_watcher(rank: int) -> None:
    """On a host without the gatherer's directory: have a :mod:`.watch` process answer from
    C for this rank when it holds the GIL (one per process, started again when an elastic
    reset renumbers the rank; none when Python's signal wake-up pipe is taken, e.g. by an
    asyncio loop's signal handlers)."""
    if SIGNAL_HELD is None:
        return
    if _state.get("watcher") is not None and _state.get("watcher_rank") != rank:
        _stop_watcher()
    if _state.get("watcher") is None and not _spawn_watcher(rank):
        return
    faulthandler.register(SIGNAL_HELD, file=_state["held"], all_threads=True, chain=False)


def _spawn_watcher(rank: int) -> bool:
    import subprocess
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:       # not the main thread
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        return False
    fd, path = tempfile.mkstemp(prefix=f"hvd_magic-stack-{rank}-")
    held = os.fdopen(fd, "ab", buffering=0)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hvd_magic.stacks.watch", str(r), str(rank),
             str(os.getpid()), str(threading.main_thread().ident), path],
            pass_fds=(r,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True)     # (signals to the rank's group are the rank's)
    except OSError:
        signal.set_wakeup_fd(-1)
        os.close(w)
        held.close()
        os.unlink(path)
        return False
    finally:
        os.close(r)
    _state.update(watcher=proc, watcher_rank=rank, wakeup=w, held=held, held_path=path)
    return True


def _stop_watcher() -> None:
    """Close the watcher's pipe: it removes its dump file and ends."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    os.close(_state.pop("wakeup"))
    _state.pop("held").close()
    proc = _state.pop("watcher")
    path = _state.pop("held_path")
    _state.pop("watcher_rank", None)
    try:
        proc.wait(WATCHER_STOP_S)
    except Exception:  # noqa: BLE001 - it hangs: it must not outlive its rank's runtime
        proc.kill()
        proc.wait()
        try:
            os.unlink(path)
        except OSError:
            pass


def _answer(signum: int, frame) -> None:
    """SIGNAL's handler (main thread, GIL held): every thread's stack."""
    fh = _state.get("file")
    if fh is None:
        return
    try:
        if not _state.get("framed"):
            faulthandler.dump_traceback(file=fh, all_threads=True)
            return
        with tempfile.TemporaryFile() as tmp:
            faulthandler.dump_traceback(file=tmp, all_threads=True)
            tmp.seek(0)
            body = tmp.read().decode(errors="replace")
        mark = FRAME.format(rank=_state["rank"])
        end = END.format(pid=os.getpid(), host=socket.gethostname(),
                         main=threading.main_thread().ident)
        text = "".join(f"{mark}{line}\n" for line in body.splitlines() + [end])
        fh.flush()
        os.write(fh.fileno(), text.encode())
        if "wakeup" in _state:            # the watcher need not answer from C
            os.write(_state["wakeup"], bytes([ANSWERED]))
    except (OSError, ValueError):
        pass       # (the file went away: nothing to answer with)


class Framed:
    """The gatherer's side of FRAME: takes the marked lines out of a job's stderr
    (:meth:`feed`) and keeps each rank's last complete answer (:meth:`wait`). Ranks' lines
    may interleave; each rank's own lines come in order."""

    def __init__(self) -> None:
        self._lines: Dict[int, List[str]] = {}
        self._done: Dict[int, tuple] = {}         # rank -> (when, RankStack)
        self._changed = threading.Condition()

    def feed(self, line: str) -> bool:
        """Take ``line`` if it is part of a rank's answer (True: not to be shown)."""
        m = _FRAMED.search(line.rstrip("\n"))
        if m is None:
            return False
        rank, rest = int(m.group(1)), m.group(2)
        end = _END.match(rest)
        if end is None:
            self._lines.setdefault(rank, []).append(rest)
            return True
        stack = RankStack(rank, threads=parse("\n".join(self._lines.pop(rank, []))),
                          main_ident=int(end.group(3)))
        with self._changed:
            self._done[rank] = (time.monotonic(), stack)
            self._changed.notify_all()
        return True

    def wait(self, ranks: Sequence[int], since: float, timeout: float) -> Dict[int, RankStack]:
        """The answers of ``ranks`` that came after ``since`` (time.monotonic()), once all
        have, or after ``timeout`` s, what came."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                got = {r: self._done[r][1] for r in ranks
                       if r in self._done and self._done[r][0] >= since}
                left = deadline - time.monotonic()
                if len(got) == len(ranks) or left <= 0:
                    return got
                self._changed.wait(left)


def answers_in(path: str, offset: int, ranks: Sequence[int],
               timeout: float = TIMEOUT) -> Dict[int, RankStack]:
    """The marked answers (:data:`FRAME`) of ``ranks`` that a job's output file ``path``
    (a pool's ``mpiexec`` log) gains after byte ``offset``: once all have come, or after
    ``timeout`` s, those that came."""
    framed = Framed()
    since = time.monotonic()
    deadline = since + timeout
    rest = b""
    while True:
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                chunk = fh.read()
        except OSError:
            chunk = b""
        offset += len(chunk)
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            framed.feed(line.decode(errors="replace"))
        got = framed.wait(ranks, since, 0.0)
        if len(got) == len(ranks) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def ask_launcher() -> bool:
    """Ask the hvdrun that started this job across hosts (``HVD_MAGIC_LAUNCHER``) to print
    every rank's stacks, which it gathers from every host; False where it does not run on
    this host (or did not start this job)."""
    given = config.get("HVD_MAGIC_LAUNCHER").split()
    if len(given) != 2 or given[1] != socket.gethostname() or not given[0].isdigit():
        return False
    try:
        os.kill(int(given[0]), signal.SIGUSR1)
    except OSError:
        return False
    return True


def _remove_own(d: str) -> None:
    path = _state.get("path")
    if not path:
        return
    stem = os.path.join(d, os.path.basename(str(path))[:-len(".stack")])
    for suffix in (".stack", ".pid", ".submitted"):
        try:
            os.unlink(stem + suffix)
        except OSError:
            pass
    try:
        os.rmdir(d)
    except OSError:
        pass     # other ranks' files are still there


def submit_site(depth: int = 2) -> str:
    """``file:line`` of the innermost frame of the user's code that called into hvd_magic
    (``depth`` frames above this call; a gradient hook's caller is ``loss.backward()``)."""
    f = sys._getframe(depth)
    while f is not None and not is_user_file(f.f_code.co_filename):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


def write_submitted(rank: int, lines: Sequence[str]) -> None:
    """Record what this rank waits for and where its code submitted it (``lines``, empty:
    nothing): read by :func:`gather` beside the stack."""
    d = _state.get("path") and os.path.dirname(str(_state["path"]))
    if not d:
        return
    path = os.path.join(d, f"{rank}.submitted")
    try:
        if not lines:
            if os.path.exists(path):
                os.unlink(path)
            return
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write("".join(line + "\n" for line in lines))
        os.replace(tmp, path)
    except OSError:
        pass


def _submitted(d: str, rank: int) -> list:
    try:
        with open(os.path.join(d, f"{rank}.submitted")) as fh:
            return [line.rstrip("\n") for line in fh if line.strip()]
    except OSError:
        return []


def _stderr():
    import sys
    return sys.__stderr__ or sys.stderr


def _read_pid(d: str, rank: int) -> Optional[tuple]:
    try:
        with open(os.path.join(d, f"{rank}.pid")) as fh:
            pid, host, main = fh.read().split()
        return int(pid), host, int(main)
    except (OSError, ValueError):
        return None


def file_size(path: str) -> int:
    """``path``'s size in bytes, 0 when it is not there."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def gather(d: Optional[str], ranks: Sequence[int], timeout: float = TIMEOUT,
           pids: Optional[Dict[int, int]] = None) -> List[RankStack]:
    """Signal each rank of ``ranks`` that runs on this host and read its stacks from ``d``,
    waiting at most ``timeout`` seconds. ``pids``: rank -> pid known to the caller (checked
    against the rank's own record)."""
    out: Dict[int, RankStack] = {r: RankStack(r) for r in ranks}
    if d is None or not os.path.isdir(d):
        for s in out.values():
            s.missing = "no stack: this job's ranks registered no stack files"
        return list(out.values())
    host = socket.gethostname()
    asked: Dict[int, tuple] = {}      # rank -> (path, offset)
    pids_of: Dict[int, int] = {}
    for r in ranks:
        rec = _read_pid(d, r)
        if rec is None:
            out[r].missing = ("no stack: it registered no stack file (it runs on another host, "
                              "or its program handles SIGUSR2 itself)")
            continue
        pid, rhost, main = rec
        if pids and r in pids and pids[r] != pid:
            out[r].missing = f"no stack: its stack file belongs to pid {pid}, not {pids[r]}"
            continue
        if rhost != host:
            out[r].missing = f"no stack: it runs on {rhost}, not on {host}"
            continue
        path = os.path.join(d, f"{r}.stack")
        offset = file_size(path)
        try:
            os.kill(pid, SIGNAL)
        except OSError as exc:
            out[r].missing = f"no stack: pid {pid} cannot be signalled ({exc.strerror})"
            continue
        out[r].main_ident = main
        asked[r] = (path, offset)
        pids_of[r] = pid
    start = time.monotonic()
    deadline = start + timeout
    held = SIGNAL_HELD is None        # whether the silent ranks were asked from C
    grown: Dict[int, tuple] = {}      # rank -> (size, when it last grew)
    while asked:
        now = time.monotonic()
        if not held and now - start >= min(ANSWER_S, timeout / 2):
            held = True    # a rank that holds the GIL in C code: its stacks from C
            for r in asked:
                if r not in grown:
                    try:
                        os.kill(pids_of[r], SIGNAL_HELD)
                    except OSError:
                        pass
        for r, (path, offset) in list(asked.items()):
            size = file_size(path)
            if size > offset:
                seen = grown.get(r)
                if seen is None or seen[0] != size:
                    grown[r] = (size, now)
                elif now - seen[1] >= SETTLE_S:
                    with open(path, "rb") as fh:
                        fh.seek(offset)
                        out[r].threads = parse(fh.read(size - offset).decode(errors="replace"))
                    del asked[r]
        if not asked or now > deadline:
            break
        time.sleep(0.02)
    for r in ranks:
        out[r].submitted = _submitted(d, r)
    for r, (path, offset) in asked.items():
        if r in grown:     # it answered, the last lines may still come: take what is there
            with open(path, "rb") as fh:
                fh.seek(offset)
                out[r].threads = parse(fh.read().decode(errors="replace"))
            continue
        out[r].missing = f"did not answer within {timeout:g} s (stopped, or gone)"
    return [out[r] for r in ranks]
