"""Doing: a cluster profile's ``setup`` lines, each on every host at once, with a barrier
between lines (the next line starts after every host finished the previous one).

On a host list the line runs through ``mpiexec`` with one process per host (the same
launcher, ssh agent and forwarded variables as the job); in a Slurm allocation through
``srun`` as a step of that job, one task per node. What to run is decided by
:func:`hvd_magic.runner.profiles.setup_steps`."""
from __future__ import annotations

import os
import subprocess
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from .plan import Host, LaunchArgs

#: Seconds a setup line may take on the slowest host.
LINE_TIMEOUT = 3600.0


def line_argv(line: str, hosts: Optional[Sequence[Host]], slurm_job: Optional[int],
              environ: Mapping[str, str]) -> "tuple[List[str], Dict[str, str]]":
    """The command and environment that run ``line`` once on each host."""
    if slurm_job is not None:
        n = len(hosts or ()) or 1
        return (["srun", f"--jobid={slurm_job}", f"--nodes={n}", f"--ntasks={n}",
                 "--ntasks-per-node=1", "--overlap", "--kill-on-bad-exit=1",
                 "--label", "sh", "-c", line], dict(environ))
    from .launch import prepare
    one_each = [Host(h.name, 1) for h in hosts] if hosts else None
    args = LaunchArgs(np=len(one_each) if one_each else 1, command=["sh", "-c", line],
                      hosts=one_each)
    return prepare(args, environ)


def run_setup(lines: Sequence[str], hosts: Optional[Sequence[Host]] = None,
              slurm_job: Optional[int] = None, environ: Optional[Mapping[str, str]] = None,
              status: Optional[Callable[[str], None]] = None,
              timeout: float = LINE_TIMEOUT) -> None:
    """Run each line on every host, in order; raise ValueError with the output of the first
    line that fails on any host."""
    env = dict(os.environ if environ is None else environ)
    for i, line in enumerate(lines, 1):
        status and status(f"hvd: setup {i}/{len(lines)} on every host: {line}")
        argv, run_env = line_argv(line, hosts, slurm_job, env)
        try:
            proc = subprocess.run(argv, env=run_env, capture_output=True, text=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ValueError(f"setup line {i} ({line!r}) ran over {timeout:g} s") from None
        if proc.returncode != 0:
            out = (proc.stdout + proc.stderr).strip()[-3000:]
            raise ValueError(f"setup line {i} ({line!r}) failed (exit {proc.returncode}); "
                             f"nothing was started. Its output:\n{out}")
