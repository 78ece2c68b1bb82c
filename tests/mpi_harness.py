"""Run a worker script on N real MPI ranks (the venv's Open MPI `mpiexec`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


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


def run_job(cmd: list, env: dict, timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run a launcher (mpiexec, hvdrun) in a session of its own; past ``timeout``, end the
    whole session (SIGTERM, so mpiexec stops its ranks; SIGKILL 3 s later) and fail with both
    streams. Killing only the launcher would leave its ranks running, using a core."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
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
