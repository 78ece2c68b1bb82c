"""The gloo controller against the MPI one and against plain torch DDP (gloo), 2 ranks.

Same models, batch and threads as ``benchmarks/torch_training.py`` (``cnn``: ~0.49 M
parameters in 10 tensors; ``mlp``: 64 linear layers, 128 tensors). Modes, each its own
2-rank job:

- ``hvd-mpi``:  hvd_magic's DistributedOptimizer under ``mpiexec`` (the MPI controller);
- ``hvd-gloo``: the same script under ``torchrun`` (the gloo controller: no MPI at all);
- ``ddp-gloo``: ``torch.nn.parallel.DistributedDataParallel`` under ``torchrun``.

Every round runs each (model, mode) once, in a rotating order, so noise from other work hits
them alike; the table shows the median images/s over rounds and the spread (min..max).

    .venv/bin/python benchmarks/controllers.py              # the table (~4 min)
    .venv/bin/python benchmarks/controllers.py --quick      # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
MODES = ("hvd-mpi", "hvd-gloo", "ddp-gloo")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl": "self,sm", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}


# ============================================================== worker (one rank)

class _Rank:
    def __init__(self, rank: int):
        self.rank = rank

    def Get_rank(self) -> int:
        return self.rank


def worker(model: str, mode: str, steps: int, windows: int) -> None:
    import torch
    from torch_training import BATCH, Trainer
    torch.set_num_threads(1)
    if mode.startswith("hvd"):
        import hvd_magic.torch as hvd
        hvd.init()
        rank, size, barrier = hvd.rank(), hvd.size(), hvd.barrier
        tr = Trainer(model, "hvd", _Rank(rank))
        controller = "gloo" if hvd.gloo_enabled() else "mpi"
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size, barrier = dist.get_rank(), dist.get_world_size(), dist.barrier
        tr = Trainer(model, "ddp", _Rank(rank))
        controller = "torch.distributed"
    tr.run(5)
    rates = []
    for _ in range(windows):
        barrier()
        r = tr.run(steps)
        rates.append(size * BATCH * steps / r["wall"])
    barrier()
    if rank == 0:
        print("RESULT " + json.dumps({"model": model, "mode": mode, "controller": controller,
                                      "size": size, "img_s": statistics.median(rates)}),
              flush=True)
    if mode.startswith("hvd"):
        hvd.shutdown()


# ============================================================== driver

def launch(model: str, mode: str, steps: int, windows: int, timeout: float) -> dict:
    py = sys.executable
    me = str(Path(__file__).resolve())
    args = ["--worker", model, mode, "--steps", str(steps), "--windows", str(windows)]
    env = dict(os.environ)
    env.update(MPI_ENV)
    if mode == "hvd-mpi":
        cmd = [str(Path(py).with_name("mpiexec")), "-n", "2", py, me, *args]
    else:
        env = {k: v for k, v in env.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
        cmd = [str(Path(py).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "0", me, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{model} {mode} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                       f"{proc.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="cnn,mlp")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 round, short windows")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], a.steps, a.windows)
        return 0
    if a.quick:
        a.rounds, a.steps, a.windows = 1, 5, 2
    models = a.models.split(",")
    pairs = [(m, mode) for m in models for mode in MODES]
    got: dict = {p: [] for p in pairs}
    for rnd in range(a.rounds):
        order = pairs[rnd % len(pairs):] + pairs[:rnd % len(pairs)]
        for model, mode in order:
            res = launch(model, mode, a.steps, a.windows, timeout=600)
            got[(model, mode)].append(res["img_s"])
            print(f"round {rnd + 1}: {model:4s} {mode:9s} {res['img_s']:8.1f} img/s "
                  f"({res['controller']})", flush=True)
    print(f"\n2 ranks, batch 32 per rank, median of {a.rounds} round(s) (min..max), images/s:")
    print(f"{'model':6s}" + "".join(f"{m:>26s}" for m in MODES) + f"{'gloo/mpi':>10s}{'gloo/ddp':>10s}")
    for model in models:
        med = {mode: statistics.median(got[(model, mode)]) for mode in MODES}
        cells = "".join(f"{med[m]:9.1f} ({min(got[(model, m)]):.0f}..{max(got[(model, m)]):.0f})"
                        .rjust(26) for m in MODES)
        print(f"{model:6s}{cells}{med['hvd-gloo'] / med['hvd-mpi']:10.2f}"
              f"{med['hvd-gloo'] / med['ddp-gloo']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
