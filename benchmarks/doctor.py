"""%hvd doctor's prediction against a measured run: the benchmark CNN on two hosts.

Two network namespaces joined by a veth pair act as two hosts (tests/netns_hosts.py, subnet
10.233.0.0/24); both ends are shaped to 1 Gbit/s with ``tc ... tbf`` (this kernel has no
netem, so latency is the veth's own). Then, per round:

1. ``single``: the CNN of benchmarks/torch_training.py (``cnn``, ~0.49 M parameters, batch
   32 of 3x32x32, one thread) trained by one process on host A: the step time ``t1``;
2. ``doctor``: ``python -m hvd_magic.runner.doctor_run -np 2 -H A,B --model-bytes
   <the CNN's gradient bytes> --step-time t1``: the predicted efficiency;
3. ``hvd``: the same CNN with ``hvd_magic.torch.DistributedOptimizer`` on one rank per host
   (``hvdrun -np 2 -H A:1,B:1``): the step time ``t2``; measured efficiency ``t1 / t2``
   (weak scaling: each rank its own batch of 32).

The two "hosts" share this VM's 2 cores (and whatever else runs on it), which real hosts do
not: two ranks computing at once are slower than one alone, and the doctor's model (one
rank's step time plus the allreduce) knows nothing of that. So each round also runs
``local``: one rank per host training at the same time with no communication (step time
``tl``), and the figure that is checked is the network's share: measured ``tl / t2``
against the prediction made with ``--step-time tl``. The plain ``t1 / t2`` and the
prediction with ``t1`` are printed beside it.

Goal: predicted within 0.1 of measured. Needs root and ``ip netns``/``tc``.

    .venv/bin/python benchmarks/doctor.py            # 3 rounds (~40 s)
    .venv/bin/python benchmarks/doctor.py --quick    # 1 round
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
SUBNET = "10.233.0.0/24"
RATE = "1gbit"
GOAL = 0.1


# ============================================================== worker (one process per rank)

def worker(mode: str, steps: int, warm: int) -> None:
    sys.path.insert(0, str(HERE))
    import torch
    from torch_training import BATCH, build_model
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rank = 0
    comm = None
    if mode == "local":                  # one per host, at the same time, no communication
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        comm.Barrier()
    if mode == "hvd":
        import hvd_magic.torch as hvd
        hvd.init()
        rank = hvd.rank()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1234 + rank)
    data = [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,),
                                                                        generator=g))
            for _ in range(4)]
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(warm + steps):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    times = times[warm:]
    windows = [statistics.fmean(times[k:k + 10]) for k in range(0, len(times) - 9, 10)]
    step = statistics.median(windows)
    if mode == "hvd":
        import hvd_magic.torch as hvd
        step = float(hvd.allreduce(torch.tensor(step), op=hvd.Max))
    if comm is not None:
        step = comm.allreduce(step, op=MPI.MAX)
    if rank == 0:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print("RESULT " + json.dumps({"step_s": step, "grad_bytes": grad_bytes}), flush=True)


# ============================================================== driver

def _result(proc: subprocess.CompletedProcess, what: str) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                       f"{proc.stderr[-3000:]}")


def driver(rounds: int, steps: int) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    import netns_hosts
    why = netns_hosts.unusable_reason()
    if why:
        print(f"doctor benchmark skipped: {why}")
        return 0
    netns_hosts.clean_stale(("hvdbA-", "hvdbB-"))
    hosts = netns_hosts.TwoHosts(subnet=SUBNET, prefix="hvdb").create()
    rows = []
    try:
        for h in hosts.hosts:
            subprocess.run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev",
                            netns_hosts.IFNAME, "root", "tbf", "rate", RATE, "burst", "128kb",
                            "latency", "50ms"], check=True, capture_output=True)
        # the two "hosts" share this machine's cores: no binding (both would take core 0)
        env = hosts.env(OMPI_MCA_btl="self,tcp", PRTE_MCA_hwloc_default_binding_policy="none",
                        OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        me = [PY, str(Path(__file__).resolve())]
        for r in range(rounds):
            single = _result(hosts.run(me + ["--worker", "single", "--steps", str(steps)],
                                       env=env, timeout=120), "single")
            t1, nbytes = single["step_s"], single["grad_bytes"]
            two = [PY, "-m", "hvd_magic.runner.cli", "-np", "2", "-H", hosts.hosts_arg,
                   "--network-interface", SUBNET, "python"] + me[1:]
            tl = _result(hosts.run(two + ["--worker", "local", "--steps", str(steps)],
                                   env=env, timeout=180), "local")["step_s"]
            proc = hosts.run([PY, "-m", "hvd_magic.runner.doctor_run", "--json", "-np", "2",
                              "-H", hosts.hosts_arg, "--network-interface", SUBNET,
                              "--model-bytes", str(nbytes), "--step-time", str(tl)],
                             env=env, timeout=90)
            if proc.returncode != 0:
                raise RuntimeError(f"doctor failed:\n{proc.stdout}\n{proc.stderr}")
            rep = json.loads(proc.stdout.strip().splitlines()[-1])
            t2 = _result(hosts.run(two + ["--worker", "hvd", "--steps", str(steps)],
                                   env=env, timeout=180), "hvd")["step_s"]
            p = rep["prediction"]
            comm = p["allreduce_time"]
            row = {"t1_ms": t1 * 1e3, "tl_ms": tl * 1e3, "t2_ms": t2 * 1e3,
                   "measured": tl / t2, "predicted": p["efficiency"],
                   "ring": p["ring_efficiency"], "plain_measured": t1 / t2,
                   "plain_predicted": t1 / (t1 + comm),
                   "link_gbit": rep["links"][0]["bandwidth"] * 8 / 1e9,
                   "latency_us": rep["links"][0]["latency"] * 1e6,
                   "allreduce_ms": comm * 1e3, "mb": nbytes / 1e6}
            rows.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
                  flush=True)
    finally:
        hosts.destroy()
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    diff = abs(med["predicted"] - med["measured"])
    print(f"\n%hvd doctor vs a measured run: the benchmark CNN ({med['mb']:.2f} MB of gradients), "
          f"2 namespace hosts, link shaped to {RATE} (median of {len(rows)} rounds)")
    print(f"  link measured by doctor:     {med['link_gbit']:.3f} Gbit/s, latency "
          f"{med['latency_us']:.0f} us")
    print(f"  step time, 1 rank alone:     {med['t1_ms']:.1f} ms")
    print(f"  step time, 1 rank per host, no communication: {med['tl_ms']:.1f} ms")
    print(f"  step time, 2 hosts (hvd):    {med['t2_ms']:.1f} ms")
    print(f"  predicted allreduce:         {med['allreduce_ms']:.1f} ms")
    print(f"  efficiency measured (tl/t2): {med['measured']:.3f}")
    print(f"  efficiency predicted:        {med['predicted']:.3f} (ideal ring on the link: "
          f"{med['ring']:.3f})")
    print(f"  plain t1/t2: measured {med['plain_measured']:.3f}, predicted with t1 "
          f"{med['plain_predicted']:.3f} (the cores the two hosts share are not modelled)")
    print(f"  {'OK' if diff <= GOAL else 'MISS'} |predicted - measured| = {diff:.3f} "
          f"(goal <= {GOAL})")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=("single", "local", "hvd"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a.steps, warm=5)
        return 0
    return driver(1 if a.quick else a.rounds, 20 if a.quick else a.steps)


if __name__ == "__main__":
    sys.exit(main())
