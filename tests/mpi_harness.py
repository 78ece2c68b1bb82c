"""Run a worker script on N real MPI ranks (the venv's Open MPI `mpiexec`)."""
from __future__ import annotations

import os
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


def mpirun(script: str, np: int, *args: str, env: dict | None = None, timeout: float = 120,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/mpi/<script> under `mpiexec -n np`; fail with both streams shown on error."""
    path = HERE / "mpi" / script
    cmd = [MPIEXEC, "-n", str(np), sys.executable, str(path), *args]
    try:
        proc = subprocess.run(cmd, env=mpi_env(env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{script} at {np} ranks did not finish within {timeout} s\n"
                             f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}") from None
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} at {np} ranks exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc
