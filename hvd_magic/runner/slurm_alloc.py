"""Doing: get, watch and release a Slurm allocation for the pool (or for hvdrun).

The decisions (``salloc``'s arguments, reading Slurm's output, the variables Open MPI needs,
the words for a failure) are in :mod:`hvd_magic.runner.slurm`; this module runs the
commands. An :class:`Allocation` is released by :meth:`Allocation.release` (``%hvd stop``,
the idle timeout), at interpreter exit, and, if the kernel is killed outright, by a small
watcher process (``python -m hvd_magic.runner.slurm_alloc watch PID JOB``) that cancels the
job once this process is gone.
"""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional

from . import slurm as plan
from .plan import Host

#: Seconds a release waits for Slurm to stop listing the cancelled job.
RELEASE_WAIT_S = 10.0
#: Seconds to wait for scontrol/scancel/squeue (they answer in well under a second).
CLIENT_TIMEOUT = 20.0


class SlurmError(ValueError):
    """A Slurm command failed (the message says which, what it printed and what to do); a
    ValueError, so the magics show it as a usage error, without a traceback."""


def _tool(name: str, environ: Mapping[str, str]) -> str:
    found = shutil.which(name, path=environ.get("PATH"))
    if not found:
        raise SlurmError(f"--slurm needs Slurm's `{name}` on PATH; run on a login node of a "
                         "Slurm cluster (or load its module: module load slurm)")
    return found


def _run(argv: List[str], environ: Mapping[str, str],
         timeout: float = CLIENT_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, env=dict(environ), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not answer in {timeout:g} s; is slurmctld "
                         "reachable (scontrol ping)?") from None


class Allocation:
    """One Slurm job holding the nodes the pool runs on."""

    def __init__(self, job: plan.JobInfo, environ: Mapping[str, str], owned: bool,
                 request: Optional[plan.SlurmRequest] = None, np: int = 0) -> None:
        self.job = job
        self.environ = dict(environ)
        self.owned = owned                   # we made it (salloc), so we release it
        self.request = request
        self.np = np
        self.addrs: Dict[str, str] = {}
        self.released = False
        self._watcher: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------------ getting one
    @classmethod
    def acquire(cls, request: plan.SlurmRequest, np: int,
                environ: Optional[Mapping[str, str]] = None,
                status: Optional[Callable[[str], None]] = None,
                watch: bool = True) -> "Allocation":
        """``salloc --no-shell`` for ``np`` ranks; blocks until Slurm grants it (an
        interrupt cancels the request)."""
        env = dict(os.environ if environ is None else environ)
        argv = plan.salloc_argv(request, np, _tool("salloc", env))
        status and status(f"hvd: asking Slurm for {np} ranks: {' '.join(argv[1:])}")
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        try:
            out, _ = proc.communicate()
        except BaseException:
            proc.terminate()                 # salloc cancels a pending request on SIGTERM
            try:
                out, _ = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                out = ""
            try:
                _run(plan.scancel_argv(plan.parse_job_id(out or ""), _tool("scancel", env)),
                     env)
            except (ValueError, SlurmError):
                pass
            raise
        try:
            job_id = plan.parse_job_id(out)
        except ValueError as exc:
            raise SlurmError(f"salloc exited {proc.returncode}: {exc}") from None
        self = cls(plan.JobInfo(job_id, "PENDING", "", ""), env, owned=True, request=request,
                   np=np)
        try:
            self.refresh(wait_nodes=True)
            self.addrs = self.node_addrs()
            if watch:
                self._start_watcher()
        except BaseException:
            self.release()
            raise
        atexit.register(self.release)
        status and status(f"hvd: Slurm job {job_id} allocated in "
                          f"{time.monotonic() - t0:.1f} s: "
                          + ", ".join(f"{h.name} ({h.slots} slots)" for h in self.hosts))
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Optional["Allocation"]:
        """The allocation this process runs inside (sbatch/salloc), used as is, or None."""
        job = plan.allocation_from_env(environ)
        return None if job is None else cls(job, environ, owned=False)

    # ------------------------------------------------------------------ reading it
    @property
    def job_id(self) -> int:
        return self.job.job_id

    @property
    def hosts(self) -> List[Host]:
        return self.job.hosts

    def env(self) -> Dict[str, str]:
        """Variables for mpiexec (PRRTE) to launch into this allocation."""
        return plan.job_env(self.job)

    def refresh(self, wait_nodes: bool = False, timeout: float = 30.0) -> plan.JobInfo:
        """Read the job again (``scontrol show job -d``); with ``wait_nodes``, until it
        runs on its nodes."""
        scontrol = _tool("scontrol", self.environ)
        deadline = time.monotonic() + timeout
        while True:
            proc = _run(plan.scontrol_job_argv(self.job_id, scontrol), self.environ)
            if proc.returncode != 0:
                if "Invalid job id" in proc.stderr:
                    self.job.state = "COMPLETED"      # purged: long gone
                    return self.job
                raise SlurmError(f"scontrol show job {self.job_id}: {proc.stderr.strip()}")
            job = plan.parse_job_detail(proc.stdout)
            if not job.nodes and self.job.nodes:   # an ended job lists no nodes any more
                job.nodes, job.nodelist = self.job.nodes, self.job.nodelist
            self.job = job
            if not wait_nodes or (self.job.state == "RUNNING" and self.job.nodes):
                return self.job
            if self.job.state in plan.ENDED_STATES:
                raise SlurmError(f"Slurm job {self.job_id} ended ({self.job.state}, "
                                 f"{self.job.reason}) before it started")
            if time.monotonic() > deadline:
                raise SlurmError(f"Slurm job {self.job_id} is {self.job.state} "
                                 f"({self.job.reason}) after {timeout:g} s")
            time.sleep(0.1)

    def node_info(self) -> Dict[str, Dict[str, str]]:
        names = [n for n, _ in self.job.nodes]
        if not names:
            return {}
        proc = _run(plan.scontrol_nodes_argv(names, _tool("scontrol", self.environ)),
                    self.environ)
        return plan.parse_nodes(proc.stdout) if proc.returncode == 0 else {}

    def node_addrs(self) -> Dict[str, str]:
        """Each node's address (``NodeAddr``; on many clusters the name itself)."""
        return {name: info.get("NodeAddr") or name for name, info in self.node_info().items()}

    def failure(self) -> str:
        """Why the allocation can no longer run the pool (naming the nodes), or ``""``."""
        if self.released:
            return ""
        try:
            job: Optional[plan.JobInfo] = self.refresh()
            nodes = self.node_info()
        except SlurmError as exc:
            return f"cannot ask Slurm about job {self.job_id}: {exc}"
        if job is not None and job.state == "COMPLETED" and not job.nodes:
            job = None
        return plan.failure_text(job, nodes, [n for n, _ in self.job.nodes], self.job_id)

    def usable(self) -> bool:
        return not self.released and not self.failure()

    def matches(self, request: Optional[plan.SlurmRequest], np: int) -> bool:
        """Can this allocation serve ``request`` for ``np`` ranks?"""
        if not self.owned:
            return request is None and np <= sum(h.slots for h in self.hosts)
        return request == self.request and np == self.np

    # ------------------------------------------------------------------ releasing it
    def release(self) -> bool:
        """``scancel`` the job if we made it; True if this call released it."""
        if self.released:
            return False
        self.released = True
        if self._watcher is not None and self._watcher.poll() is None:
            self._watcher.kill()
            self._watcher.wait()
        if not self.owned:
            return False
        try:
            _run(plan.scancel_argv(self.job_id, _tool("scancel", self.environ)), self.environ)
            # the job stays listed as COMPLETING while slurmd ends its steps (about a second):
            # wait for that, so that what `squeue` shows after `%hvd stop` is the truth
            deadline = time.monotonic() + RELEASE_WAIT_S
            argv = plan.squeue_job_argv(self.job_id, _tool("squeue", self.environ))
            while _run(argv, self.environ).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.1)
        except SlurmError:
            return False
        return True

    def _start_watcher(self) -> None:
        self._watcher = subprocess.Popen(
            [sys.executable, "-m", "hvd_magic.runner.slurm_alloc", "watch", str(os.getpid()),
             str(self.job_id)], env=self.environ, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


class IdleReaper:
    """Calls ``stop()`` once ``idle_s()`` (seconds since the last use, None while in use)
    passes ``timeout``; checks every ``period`` s in a daemon thread until cancelled."""

    def __init__(self, idle_s: Callable[[], Optional[float]], timeout: float,
                 stop: Callable[[], None], period: float = 0.5) -> None:
        self.idle_s, self.timeout, self.stop_fn, self.period = idle_s, timeout, stop, period
        self._done = threading.Event()
        threading.Thread(target=self._loop, name="hvd-slurm-idle", daemon=True).start()

    def _loop(self) -> None:
        while not self._done.wait(self.period):
            idle = self.idle_s()
            if idle is not None and idle > self.timeout and not self._done.is_set():
                self._done.set()
                self.stop_fn()
                return

    def cancel(self) -> None:
        self._done.set()


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie that its parent has not reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _watch(pid: int, job_id: int) -> int:
    """Cancel ``job_id`` once process ``pid`` is gone (the kernel was killed)."""
    while _running(pid):
        time.sleep(0.5)
    env = dict(os.environ)
    subprocess.run(plan.scancel_argv(job_id, _tool("scancel", env)), env=env,
                   capture_output=True, timeout=CLIENT_TIMEOUT)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "watch":
        sys.exit(_watch(int(sys.argv[2]), int(sys.argv[3])))
    sys.exit("usage: python -m hvd_magic.runner.slurm_alloc watch PID JOB_ID")
