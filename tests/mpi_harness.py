"""Run a worker script on N real ranks: under the venv's Open MPI `mpiexec` (the MPI
controller), or under `torchrun` (the gloo controller: no MPI at all)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from hvd_magic.runner.launch import clear_stale_sessions

HERE = Path(__file__).parent
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
#: The launchers a worker script runs under: one test, two controllers.
LAUNCHERS = ("mpiexec", "torchrun")


def mpi_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
        "OMPI_MCA_btl": "self,sm", "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    })
    env.update(extra or {})
    return env


def start_job(cmd: list, env: dict) -> subprocess.Popen:
    """Start a launcher in a session of its own, its output piped. Session files of
    launchers killed earlier (a test may kill one) are cleared first, as hvdrun does."""
    clear_stale_sessions(env)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def run_job(cmd: list, env: dict, timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run a launcher (mpiexec, hvdrun) with :func:`start_job`; past ``timeout``, end the
    whole session (SIGTERM, so mpiexec stops its ranks; SIGKILL 3 s later) and fail with both
    streams. Killing only the launcher would leave its ranks running, using a core."""
    proc = start_job(cmd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
                out, err = proc.communicate(timeout=grace)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                out = err = ""
        raise AssertionError(f"{what} did not finish within {timeout} s (hung)\n"
                             f"stdout:\n{out}\nstderr:\n{err}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def mpirun(script: str, np: int, *args: str, env: dict | None = None, timeout: float = 120,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/mpi/<script> under `mpiexec -n np`; fail with both streams shown on error."""
    path = HERE / "mpi" / script
    cmd = [MPIEXEC, "-n", str(np), sys.executable, str(path), *args]
    proc = run_job(cmd, mpi_env(env), timeout, f"{script} at {np} ranks")
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} at {np} ranks exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def torch_env(extra: dict | None = None) -> dict:
    """The environment of a torchrun job: none of an MPI launcher's variables (the ranks
    must find no MPI world), one thread per rank."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                # (rank 0's store and gloo stay on loopback)
                "GLOO_SOCKET_IFNAME": "lo"})
    env.update(extra or {})
    return env


def torchrun(script: str, np: int, *args: str, env: dict | None = None, timeout: float = 120,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/mpi/<script> under `torchrun --standalone --nproc-per-node np` (a free
    port on this host); fail with both streams shown on error."""
    path = HERE / "mpi" / script
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(np), "--max-restarts", "0",
           str(path), *args]
    proc = run_job(cmd, torch_env(env), timeout, f"{script} at {np} ranks under torchrun")
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} at {np} ranks under torchrun exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def launch(launcher: str, script: str, np: int, *args: str, **kw) -> subprocess.CompletedProcess:
    """:func:`mpirun` or :func:`torchrun` (``launcher`` one of :data:`LAUNCHERS`)."""
    return (torchrun if launcher == "torchrun" else mpirun)(script, np, *args, **kw)


def probes(stdout: str) -> dict:
    """rank -> the fields of each rank's probe line (tests/mpi/controller_probe.py)."""
    out = {}
    for line in re.findall(r"probe (rank=.*)", stdout):
        fields = dict(kv.split("=", 1) for kv in line.split())
        out[int(fields["rank"])] = fields
    return out
