"""Cost of the live widgets: a 2-rank torch training cell's throughput with every widget live
(WidgetSink: telemetry thread on each rank, timeline events, log lanes, bokeh timeline)
against the same cell with ``--no-stream`` (plain text, no telemetry). Side by side in one
real ipykernel (started with jupyter_client; the widgets send their comm messages as in a
notebook, no browser draws them), alternating, medians. Target: within 2%.

    .venv/bin/python benchmarks/widgets.py [--rounds 30] [--steps 1500]

On the 2-core VM one round's ratio spreads 0.7 to 1.3, so the default takes 30 rounds of
1500-step cells (about 2.5 minutes); 10 rounds gave medians from 0.92 to 0.99 of one setting.

Throughput on a shared 2-core machine moves with everyone else's load; CPU time much less.
So each cell's CPU seconds are also counted, per 1000 steps, for each process that the
cell keeps busy: the kernel, each rank, the ipyparallel controller (and mpiexec), and this
script (which reads the kernel's messages, as a notebook's front end would). With 2 ranks
on 2 cores, CPU that the kernel and controller spend is taken from the ranks.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

CELL = """%%hvd -np 2 {flags}
import time, torch
import hvd_magic.torch as hvd
from hvd_magic.widgets import report
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
for step in range({warm}):
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
t0 = time.perf_counter()
for step in range({steps}):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    report(samples=64)
    if step % 100 == 0:
        print(f"step {{step}} loss {{loss.item():.4f}}")
tput = 64 * {steps} / (time.perf_counter() - t0)
"""


def run(kc, code: str, timeout: float = 300) -> list:
    msg_id = kc.execute(code)
    outs = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        t = msg["msg_type"]
        if t == "stream":
            outs.append(msg["content"]["text"])
        elif t == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
        elif t == "status" and msg["content"]["execution_state"] == "idle":
            return outs


def cpu_seconds(kernel_pid: int, rank_pids: dict) -> dict:
    """user + system CPU seconds so far: the kernel, each rank, the other processes the
    kernel started (controller, mpiexec), and this script."""
    import psutil
    out = {"kernel": 0.0, "controller, mpiexec": 0.0, "this client": 0.0}
    out.update({f"rank {r}": 0.0 for r in sorted(rank_pids.values())})
    k = psutil.Process(kernel_pid)
    for p in [k] + k.children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        role = ("kernel" if p.pid == kernel_pid else f"rank {rank_pids[p.pid]}"
                if p.pid in rank_pids else "controller, mpiexec")
        out[role] += t.user + t.system
    t = psutil.Process().cpu_times()
    out["this client"] = t.user + t.system
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=1500)
    args = ap.parse_args()
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        run(kc, "%load_ext hvd_magic\n"
                "from hvd_magic.widgets.session import session as _s\n")
        res = {"widgets": [], "no-stream": []}
        order = ["widgets", "no-stream"]
        run(kc, CELL.format(flags="--no-stream", steps=50, warm=5))      # pool start, warm-up
        run(kc, CELL.format(flags="", steps=50, warm=5))     # BokehJS loads once per kernel
        out = "".join(run(kc, "%%hvd --no-stream\nimport os, hvd_magic.collectives as h\n"
                              "print('PID', h.rank(), os.getpid())"))
        ranks = {int(ln.split()[-1]): int(ln.split()[-2]) for ln in out.splitlines() if "PID" in ln}
        kpid = km.provisioner.process.pid
        cpu: dict = {"widgets": [], "no-stream": []}
        for i in range(args.rounds):
            for mode in (order if i % 2 == 0 else order[::-1]):
                flags = "--no-stream" if mode == "no-stream" else ""
                before = cpu_seconds(kpid, ranks)
                run(kc, CELL.format(flags=flags, steps=args.steps, warm=20))
                after = cpu_seconds(kpid, ranks)
                cpu[mode].append({k: (after[k] - before[k]) * 1000 / args.steps for k in after})
                out = "".join(run(kc, "%hvd pull tput\nprint('TPUT', sum(tput), type(_s().last_sink).__name__)"))
                val = float(out.split("TPUT")[1].split()[0])
                res[mode].append(val)
                print(f"round {i} {mode:9s} {val:9.0f} samples/s (2 ranks) "
                      f"{out.split()[-1] if mode == 'widgets' else ''}", flush=True)
        live_out = "".join(run(kc, "print(_s().last_cell.summary_text()); "
                                   "print('batches', _s().last_sink.batches); "
                                   "import os\n"
                                   "if os.path.exists('/proc/self/autogroup'): "
                                   "print('kernel scheduler group:', "
                                   "open('/proc/self/autogroup').read().strip())"))
        run(kc, "%hvd stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    w, n = statistics.median(res["widgets"]), statistics.median(res["no-stream"])
    ratio = w / n
    # Each round runs the two cells back to back (order alternating), so the per-round ratio
    # cancels the machine's drift between rounds (on the 2-core VM a whole round can run
    # 20-30% slower than the next); its median is the figure the target is judged on.
    paired = [a / b for a, b in zip(res["widgets"], res["no-stream"])]
    pr = statistics.median(paired)
    print(f"\nmedian throughput: widgets {w:.0f} samples/s, --no-stream {n:.0f} samples/s, "
          f"ratio of medians {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
    print(f"per-round ratios (widgets / --no-stream, same round): "
          f"{' '.join(f'{x:.3f}' for x in paired)}; median {pr:.3f} ({(pr - 1) * 100:+.1f}%)")
    print("\nCPU seconds per 1000 steps (whole cell, medians of the rounds):")
    print(f"  {'process':22s} {'widgets':>8s} {'--no-stream':>11s} {'difference':>10s}")
    for k in cpu["widgets"][0]:
        a = statistics.median(c[k] for c in cpu["widgets"])
        b = statistics.median(c[k] for c in cpu["no-stream"])
        print(f"  {k:22s} {a:8.3f} {b:11.3f} {a - b:+10.3f}")
    print("last widget cell, as the text summary:\n" + live_out)
    print(("PASS" if pr >= 0.98 else "MISS") + " widgets within 2% of --no-stream "
          "(median of the per-round ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
