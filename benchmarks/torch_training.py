"""Data-parallel torch training: hvd_magic's DistributedOptimizer against torch DDP (gloo).

Weak scaling on one host: every rank trains on its own synthetic batch of 32 images
(3x32x32), one intra-op thread per rank (``torch.set_num_threads(1)``, OMP_NUM_THREADS=1).
Two models:

- ``cnn``: a small CNN, ~0.49 M parameters in 10 tensors (compute-bound step);
- ``mlp``: 64 linear layers of width 96 (128 parameter tensors; per-tensor overhead dominates).

Modes, each its own ``mpiexec`` job (launched by this script, the *driver*):

- ``single``: 1 rank, plain training (no hvd, no DDP): the baseline;
- ``hvd``:    2 ranks, ``hvd_magic.torch.DistributedOptimizer`` (+ broadcasts);
- ``ddp``:    2 ranks, ``torch.nn.parallel.DistributedDataParallel``, gloo process group from
              the MPI rank/size with a ``TCPStore`` on 127.0.0.1;
- ``local``:  2 ranks training independently, no communication (reference: what this
              machine allows at 2 ranks at all).

Scaling efficiency = images/s at 2 ranks / (2 x images/s of ``single``). Every round runs
each (model, mode) once, in a rotating order, so noise from other work hits them alike;
the table shows medians over rounds and the spread (min..max). Each job warms up, then
times several windows of equal step counts; its figure is the median window.

    .venv/bin/python benchmarks/torch_training.py                  # the table (~3 min)
    .venv/bin/python benchmarks/torch_training.py --quick          # smoke test
    .venv/bin/python benchmarks/torch_training.py --sweep          # + HOROVOD_CYCLE_TIME / fusion variants
    .venv/bin/python benchmarks/torch_training.py --timeline /tmp/tl --models mlp   # + one traced hvd job

The sweep runs inside one 2-rank job per model: for each variant, set the environment,
``hvd.init()``, train, ``hvd.shutdown()``, in a rotating order over several rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BATCH = 32
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl": "self,sm", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}
MODES = ("single", "hvd", "ddp", "local")
SWEEP = [  # (label, environment)
    ("cycle 0 ms (default)", {"HOROVOD_CYCLE_TIME": "0"}),
    ("cycle 0.5 ms", {"HOROVOD_CYCLE_TIME": "0.5"}),
    ("cycle 1 ms", {"HOROVOD_CYCLE_TIME": "1"}),
    ("cycle 2 ms", {"HOROVOD_CYCLE_TIME": "2"}),
    ("fusion 1 MiB", {"HOROVOD_FUSION_THRESHOLD": str(1 << 20)}),
    ("fusion 0 (off)", {"HOROVOD_FUSION_THRESHOLD": "0"}),
    ("cycle 1 ms, fusion 1 MiB", {"HOROVOD_CYCLE_TIME": "1", "HOROVOD_FUSION_THRESHOLD": str(1 << 20)}),
]
SWEEP_KEYS = ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD")


# ============================================================== worker (inside mpiexec)

def build_model(name: str):
    import torch.nn as nn
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 32x16x16
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),     # 64x8x8
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # 128x4x4
            nn.Flatten(), nn.Linear(128 * 4 * 4, 192), nn.ReLU(), nn.Linear(192, 10))
    if name == "mlp":
        layers = [nn.Flatten(), nn.Linear(3 * 32 * 32, 96), nn.ReLU()]
        for _ in range(62):
            layers += [nn.Linear(96, 96), nn.ReLU()]
        layers.append(nn.Linear(96, 10))           # 64 Linear layers, 128 parameter tensors
        return nn.Sequential(*layers)
    raise ValueError(name)


def _engine_tid() -> int:
    import threading
    for t in threading.enumerate():
        if t.name.startswith("hvd_magic-engine"):
            return t.native_id
    return 0


def _task_cpu(tid: int) -> float:
    """utime+stime of one thread of this process, seconds (10 ms resolution)."""
    if not tid:
        return 0.0
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


class Trainer:
    """One training setup; ``run(n)`` does n steps and returns per-phase timings."""

    def __init__(self, model_name: str, mode: str, comm, seed: int = 0):
        import torch
        self.torch = torch
        self.mode = mode
        self.comm = comm
        self.rank = comm.Get_rank()
        torch.manual_seed(seed)
        self.model = build_model(model_name)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.n_tensors = sum(1 for _ in self.model.parameters())
        g = torch.Generator().manual_seed(1234 + self.rank)
        self.data = [(torch.randn(BATCH, 3, 32, 32, generator=g),
                      torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(4)]
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.net = self.model
        self.hvd = None
        if mode == "ddp":
            self.net = torch.nn.parallel.DistributedDataParallel(self.model)
        self.make_optimizer()
        self.i = 0

    def make_optimizer(self) -> None:
        torch = self.torch
        opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        if self.mode == "hvd":
            import hvd_magic.torch as hvd
            self.hvd = hvd
            opt = hvd.DistributedOptimizer(opt, named_parameters=self.model.named_parameters())
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        self.opt = opt

    def run(self, n: int) -> dict:
        """n training steps; returns wall seconds and per-phase sums."""
        perf = time.perf_counter
        fb = sync = stp = 0.0
        hvd_mode = self.mode == "hvd"
        eng = None
        if hvd_mode:
            from hvd_magic.collectives import state as hstate
            eng = hstate.engine()
            c0 = eng.cycles
        tid = _engine_tid() if hvd_mode else 0
        cpu_main0, cpu_proc0, cpu_eng0 = time.thread_time(), time.process_time(), _task_cpu(tid)
        t_start = perf()
        for _ in range(n):
            x, y = self.data[self.i % len(self.data)]
            self.i += 1
            t0 = perf()
            self.opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.net(x), y)
            loss.backward()
            t1 = perf()
            if hvd_mode:
                self.opt.synchronize()
                t2 = perf()
                with self.opt.skip_synchronize():
                    self.opt.step()
            else:
                t2 = t1
                self.opt.step()
            t3 = perf()
            fb += t1 - t0
            sync += t2 - t1
            stp += t3 - t2
        wall = perf() - t_start
        out = {"wall": wall, "steps": n, "fwd_bwd": fb, "sync": sync, "step": stp,
               "cpu_main": time.thread_time() - cpu_main0,
               "cpu_other": (time.process_time() - cpu_proc0) - (time.thread_time() - cpu_main0),
               "loss": float(loss.detach())}
        if hvd_mode:
            out["cycles"] = eng.cycles - c0
            out["cpu_engine"] = _task_cpu(tid) - cpu_eng0
        return out


def _agree(comm, value: int) -> int:
    return comm.allreduce(value, op=_mpi().MIN) if comm.Get_size() > 1 else value


def _mpi():
    from mpi4py import MPI
    return MPI


def measure(tr: Trainer, comm, seconds: float, windows: int, warm_s: float) -> dict:
    """Warm up, then ``windows`` timed windows of equal step counts (same on every rank)."""
    tr.run(3)
    probe = tr.run(3)
    per_step = probe["wall"] / 3
    warm = _agree(comm, max(2, int(warm_s / per_step)))
    tr.run(warm)
    n = _agree(comm, max(3, int(seconds / windows / per_step)))
    res = []
    for _ in range(windows):
        comm.Barrier()
        r = tr.run(n)
        walls = comm.allgather(r["wall"])
        # All ranks run the same steps; images/s of the job: every rank's images over the
        # slowest rank's time (for ``local`` too, which has no step-to-step coupling).
        r["ips"] = comm.Get_size() * BATCH * n / max(walls)
        res.append(r)
    return _summarise(res)


def _summarise(res: list) -> dict:
    res = sorted(res, key=lambda r: r["ips"])
    mid = res[len(res) // 2]
    out = {"ips": mid["ips"], "ips_all": [r["ips"] for r in res]}
    for k in ("fwd_bwd", "sync", "step", "cpu_main", "cpu_other", "cpu_engine", "cycles", "wall"):
        if k in mid:   # per step, from the median window (an outlier window would skew a mean)
            out[k + "_per_step"] = mid[k] / mid["steps"]
    out["loss"] = res[-1]["loss"]
    return out


def worker(args) -> None:
    import torch
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    torch.set_flush_denormal(True)
    if os.environ.get("BENCH_SWITCH_INTERVAL"):   # experiment: GIL switch interval, seconds
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
    MPI = _mpi()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    result: dict = {"mode": args.mode, "model": args.model, "size": size}
    if args.mode == "ddp":
        import torch.distributed as dist
        store = torch.distributed.TCPStore("127.0.0.1", args.port, size, rank == 0,
                                           timeout=__import__("datetime").timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    if args.mode == "hvd":
        import hvd_magic.torch as hvd
        hvd.init()
    if args.mode == "sweep":
        result["variants"] = sweep(args, comm)
    else:
        tr = Trainer(args.model, args.mode, comm)
        result.update(params=tr.n_params, tensors=tr.n_tensors)
        if args.timeline and args.mode == "hvd":
            tr.run(5)
            tr.hvd.start_timeline(args.timeline, mark_cycles=True)
            result["timeline_steps"] = tr.run(10)
            tr.hvd.stop_timeline()
        result.update(measure(tr, comm, args.seconds, args.windows, args.warm))
    if args.mode == "ddp":
        import torch.distributed as dist
        dist.destroy_process_group()
    if args.mode in ("hvd", "sweep"):
        import hvd_magic.torch as hvd
        hvd.shutdown()
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def sweep(args, comm) -> dict:
    import hvd_magic.torch as hvd
    tr = None
    out: dict = {label: [] for label, _ in SWEEP}
    for rnd in range(args.rounds):
        k = rnd % len(SWEEP)
        for label, env in SWEEP[k:] + SWEEP[:k]:
            for key in SWEEP_KEYS:
                os.environ.pop(key, None)
            os.environ.update(env)
            hvd.init()
            if tr is None:
                tr = Trainer(args.model, "hvd", comm)
            else:
                tr.make_optimizer()     # a new DistributedOptimizer takes over the hooks
            r = measure(tr, comm, args.seconds, args.windows, args.warm)
            hvd.shutdown()
            out[label].append(r)
    return out


# ============================================================== driver

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, model: str, args, extra_env: dict | None = None, extra: list | None = None) -> dict:
    n = 1 if mode == "single" else 2
    mpiexec = Path(sys.executable).parent / "mpiexec"
    argv = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(n)] + args.mpiexec_args.split() + [sys.executable,
            str(Path(__file__).resolve()), "--worker", "--mode", mode, "--model", model,
            "--seconds", str(args.seconds), "--windows", str(args.windows), "--warm", str(args.warm),
            "--port", str(_free_port())] + (extra or [])
    env = dict(os.environ)
    for k, v in MPI_ENV.items():
        env.setdefault(k, v)
    env.update(extra_env or {})
    p = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{mode}/{model} failed (exit {p.returncode}):\n{p.stdout[-3000:]}")


def med(xs: list) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list, fmt: str = "{:.0f}") -> str:
    return (fmt + "..." + fmt).format(min(xs), max(xs)) if xs else "-"


def driver(args) -> int:
    import platform
    t_all = time.monotonic()
    models = args.models.split(",")
    results: dict = {(m, md): [] for m in models for md in MODES}
    info: dict = {}
    order = list(MODES)
    for rnd in range(args.rounds):
        for mi, model in enumerate(models):
            k = (rnd + mi) % len(order)
            for mode in order[k:] + order[:k]:
                r = launch(mode, model, args)
                results[(model, mode)].append(r)
                info[model] = (r.get("params"), r.get("tensors"))
                if args.verbose:
                    print(f"  round {rnd} {model:4s} {mode:6s} {r['ips']:8.1f} img/s "
                          f"windows {[round(x) for x in r['ips_all']]}", flush=True)
    try:
        import torch
        tv = torch.__version__
    except ImportError:
        tv = "?"
    print(f"torch training, weak scaling (batch {BATCH} of 3x32x32 per rank, 1 intra-op thread per rank) "
          f"-- hvd_magic DistributedOptimizer vs torch DDP (gloo)")
    print(f"host: {platform.node()}, {os.cpu_count()} CPUs; torch {tv}; {args.rounds} rounds x "
          f"{args.windows} windows of ~{args.seconds / args.windows:.1f} s per job; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("images/s: medians over rounds (spread min...max); eff = 2-rank img/s / (2 x median 1-rank img/s)\n")
    W = 20
    hdr = (f"{'model':5s} {'params':>7s} {'tensors':>7s} | {'1 rank':>{W}s} | {'hvd 2 ranks':>{W}s} {'eff':>5s} | "
           f"{'DDP 2 ranks':>{W}s} {'eff':>5s} | {'no comm (ref)':>{W}s} {'eff':>5s}")
    print(hdr)
    print("-" * len(hdr))
    effs: dict = {}
    for model in models:
        def col(mode):
            xs = [r["ips"] for r in results[(model, mode)]]
            return med(xs), xs
        base, bx = col("single")
        cells = [f"{base:6.0f} ({spread(bx)})".rjust(W)]
        for mode in ("hvd", "ddp", "local"):
            v, xs = col(mode)
            effs[(model, mode)] = v / (2 * base)
            cells.append(f"{v:6.0f} ({spread(xs)})".rjust(W) + f" {v / (2 * base):5.2f}")
        p, t = info[model]
        print(f"{model:5s} {p / 1e6:6.2f}M {t:7d} | " + " | ".join(cells))
    print("\nefficiency spread over rounds (each round's 2-rank result / 2 x that round's 1-rank result):")
    for model in models:
        parts = []
        for mode in ("hvd", "ddp", "local"):
            es = [r["ips"] / (2 * s["ips"]) for r, s in zip(results[(model, mode)], results[(model, "single")])]
            parts.append(f"{mode} {med(es):.2f} ({spread(es, '{:.2f}')})")
        print(f"  {model}: " + ", ".join(parts))

    print("\nwhere the time goes, per step (ms; medians over rounds; rank 0):")
    print(f"  {'model':5s} {'mode':6s} {'step':>6s} {'fwd+bwd':>8s} {'sync':>6s} {'opt':>6s} "
          f"{'cpu main':>8s} {'cpu other thr':>13s} {'engine cpu':>10s} {'cycles':>6s}")
    for model in models:
        for mode in MODES:
            rs = results[(model, mode)]
            g = lambda k: med([r.get(k + "_per_step", float("nan")) for r in rs])  # noqa: E731
            print(f"  {model:5s} {mode:6s} {1e3 * g('wall'):6.2f} {1e3 * g('fwd_bwd'):8.2f} "
                  f"{1e3 * g('sync'):6.2f} {1e3 * g('step'):6.2f} {1e3 * g('cpu_main'):8.2f} "
                  f"{abs(1e3 * g('cpu_other')):13.2f} "
                  + (f"{1e3 * g('cpu_engine'):10.2f} {g('cycles'):6.1f}" if mode == "hvd" else f"{'':10s} {'':6s}"))
    print("  (step: wall time per step; fwd+bwd includes submitting hvd's allreduces from the hooks and,"
          " for DDP, its allreduces;\n   sync: optimizer.synchronize() wait; cpu other thr: process CPU"
          " minus main thread (engine / gloo threads))")

    if args.sweep:
        print("\nhvd_magic settings sweep (one 2-rank job per model, variants rotated over "
              f"{args.sweep_rounds} rounds; eff against the 1-rank median above):")
        print(f"  {'model':5s} {'variant':26s} {'img/s':>7s} {'spread':>12s} {'eff':>5s} "
              f"{'cycles/step':>11s} {'sync ms':>7s} {'engine cpu ms':>13s}")
        for model in models:
            base = med([r["ips"] for r in results[(model, "single")]])
            sargs = argparse.Namespace(**vars(args))
            r = launch("sweep", model, sargs, extra=["--rounds", str(args.sweep_rounds)])
            for label, _ in SWEEP:
                rs = r["variants"][label]
                xs = [x["ips"] for x in rs]
                g = lambda k: med([x.get(k + "_per_step", float("nan")) for x in rs])  # noqa: E731
                print(f"  {model:5s} {label:26s} {med(xs):7.0f} {spread(xs):>12s} {med(xs) / (2 * base):5.2f} "
                      f"{g('cycles'):11.1f} {1e3 * g('sync'):7.2f} {1e3 * g('cpu_engine'):13.2f}")

    if args.timeline:
        for model in models:
            path = str(Path(args.timeline) / f"hvd_{model}.json")
            r = launch("hvd", model, args, extra=["--timeline", path])
            ts = r["timeline_steps"]
            print(f"\ntimeline of 10 hvd steps ({model}): {path}; per step {1e3 * ts['wall'] / 10:.2f} ms, "
                  f"{ts['cycles'] / 10:.1f} cycles, sync {1e3 * ts['sync'] / 10:.2f} ms")

    print("\ntargets:")
    checks = []
    for model in models:
        checks.append((f"{model}: hvd_magic efficiency >= DDP's",
                       effs[(model, "hvd")] >= effs[(model, "ddp")],
                       f"{effs[(model, 'hvd')]:.2f} vs {effs[(model, 'ddp')]:.2f}"))
    if "cnn" in models:
        checks.append(("cnn: hvd_magic efficiency >= 0.9", effs[("cnn", "hvd")] >= 0.9,
                       f"{effs[('cnn', 'hvd')]:.2f}"))
    for text, ok, val in checks:
        print(f"  {'PASS' if ok else 'MISS'}  {text:40s} {val}")
    print(f"summary: {sum(ok for _, ok, _ in checks)} PASS, {sum(not ok for _, ok, _ in checks)} MISS")
    print(f"(benchmark took {time.monotonic() - t_all:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{m}/{md}": v for (m, md), v in results.items()}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cnn,mlp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.4, help="timed seconds per job")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--warm", type=float, default=0.6, help="warm-up seconds per job")
    ap.add_argument("--quick", action="store_true", help="1 round, short windows")
    ap.add_argument("--sweep", action="store_true", help="also HOROVOD_CYCLE_TIME / fusion variants")
    ap.add_argument("--sweep-rounds", type=int, default=3)
    ap.add_argument("--timeline", default="", help="directory: also trace one hvd job per model")
    ap.add_argument("--json", default="")
    ap.add_argument("--mpiexec-args", default="", help="extra mpiexec options, e.g. '--bind-to none'")
    ap.add_argument("-v", "--verbose", action="store_true")
    # worker side
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.warm, args.sweep_rounds = 1, 0.9, 0.3, 1
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
