"""Run hvd_magic's benchmarks one after another and print their reports (``make bench``).

Each benchmark is an entry in ``BENCHMARKS``: a name, the command (MPI jobs are launched
with this venv's ``mpiexec``), extra environment and a time limit. To add one (torch
training, pool start, ...), append an entry.

    .venv/bin/python benchmarks/run_all.py                 # everything
    .venv/bin/python benchmarks/run_all.py --list
    .venv/bin/python benchmarks/run_all.py collectives -- --quick   # args after -- go to it
    .venv/bin/python benchmarks/run_all.py --strict        # exit 1 when a target is missed

Exit status: 1 when a benchmark fails (or, with --strict, reports a MISS), else 0.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent            # the venv's bin/ (sys.executable is not resolved)
PYTHON = sys.executable

# Open MPI as root on one host, shared memory only (see /work/shared/FACTS.md).
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl": "self,sm"}


def mpiexec() -> str:
    exe = BIN / "mpiexec"
    if exe.exists():
        return str(exe)
    found = shutil.which("mpiexec")
    if found is None:
        sys.exit("run_all: no mpiexec next to the python running this script, nor on PATH; "
                 "run `make setup` first")
    return found


def mpi_job(script: str, n: int = 2) -> list:
    """argv that runs ``script`` (relative to the repo root) on ``n`` local ranks."""
    return [mpiexec(), "-n", str(n), PYTHON, str(ROOT / script)]


@dataclass
class Benchmark:
    name: str
    argv: list
    env: dict = field(default_factory=dict)
    timeout_s: float = 300.0
    about: str = ""


def benchmarks() -> list:
    return [
        Benchmark("collectives", mpi_job("benchmarks/collectives.py", 2), dict(MPI_ENV), 300.0,
                  "hvd_magic allreduce vs raw mpi4py, 2 ranks: sizes, 100 small tensors, idle/wait CPU"),
        Benchmark("torch_training", [PYTHON, str(ROOT / "benchmarks/torch_training.py")], {}, 420.0,
                  "torch training 1 vs 2 ranks (CNN, 64-layer MLP): hvd DistributedOptimizer vs DDP (gloo)"),
        Benchmark("pool", [PYTHON, str(ROOT / "benchmarks/pool.py")], {}, 600.0,
                  "%%hvd pool start to first output and empty-cell round trip vs ipyparallel"),
        Benchmark("widgets", [PYTHON, str(HERE / "widgets.py")], dict(MPI_ENV), 600.0,
                  "2-rank torch cell: live widgets vs --no-stream throughput (target within 2%)"),
        Benchmark("kernel_memory", [PYTHON, str(HERE / "kernel_memory.py")], dict(MPI_ENV), 900.0,
                  "a real kernel's and its ranks' memory after 50 and 1,000 live %%hvd cells"),
        Benchmark("keras_training", [PYTHON, str(HERE / "keras_training.py")], dict(MPI_ENV), 900.0,
                  "Keras CNN images/s at 1 and 2 ranks, hvd_magic.keras vs MultiWorkerMirroredStrategy"),
        Benchmark("elastic", [mpiexec(), "--with-ft", "ulfm", "--oversubscribe", "-n", "3", PYTHON,
                              str(ROOT / "benchmarks/elastic.py")], dict(MPI_ENV), 300.0,
                  "elastic commit() of 25 M parameters vs a step and torch.save; kill-to-resume time"),
        Benchmark("autotune", mpi_job("benchmarks/autotune.py", 2), dict(MPI_ENV), 600.0,
                  "HOROVOD_AUTOTUNE's chosen setting vs the best of a 36-setting grid search, 2 ranks"),
        Benchmark("doctor", [PYTHON, str(HERE / "doctor.py")], {}, 300.0,
                  "%hvd doctor's predicted 2-host efficiency for the CNN vs measured, 1 Gbit/s link"),
        Benchmark("scale", [PYTHON, str(HERE / "scale.py")], dict(MPI_ENV), 1200.0,
                  "coordination bytes/time per cycle at 2-32 ranks: now vs before the response "
                  "cache vs raw MPI; modelled to 1,024"),
    ]


def run(b: Benchmark, extra: list) -> tuple:
    env = dict(os.environ)
    for k, v in b.env.items():
        env.setdefault(k, v)
    argv = b.argv + extra
    shown = " ".join(f"{k}={v}" for k, v in b.env.items()) + " " + " ".join(argv)
    print(f"=== {b.name}: {shown}", flush=True)
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=b.timeout_s)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\nrun_all: {b.name} did not finish within {b.timeout_s:g} s\n"
        rc = 124
    print(out, end="" if out.endswith("\n") else "\n", flush=True)
    print(f"=== {b.name}: exit {rc} after {time.monotonic() - t0:.0f} s\n", flush=True)
    return rc, out


def main() -> int:
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description="Run hvd_magic's benchmarks.")
    ap.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a benchmark reports a MISS")
    args = ap.parse_args(argv)
    table = benchmarks()
    if args.list:
        for b in table:
            print(f"{b.name:15s} {b.about}")
        return 0
    known = {b.name for b in table}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"run_all: unknown benchmark(s) {unknown}; known: {sorted(known)}", file=sys.stderr)
        return 2
    chosen = [b for b in table if not args.names or b.name in args.names]
    failed, missed = [], []
    for b in chosen:
        rc, out = run(b, extra)
        if rc != 0:
            failed.append(b.name)
        if any(line.lstrip().startswith("MISS ") for line in out.splitlines()):
            missed.append(b.name)
    if failed:
        print(f"run_all: failed: {', '.join(failed)}")
    if missed:
        print(f"run_all: targets missed in: {', '.join(missed)}")
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
