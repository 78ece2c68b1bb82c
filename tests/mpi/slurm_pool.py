"""Driver of the Slurm pool tests, run on node 1 as the notebook kernel would be:
``python slurm_pool.py SCENARIO NODE2``; prints one ``RESULT {json}`` line.

``cells``: ``%%hvd -np 4 --slurm --nodes 2`` trains a small torch model through a real
IPython shell (ranks report their hostnames); ``squeue`` while the pool lives; a second
cell reuses the pool and the job; ``%hvd stop``; ``squeue`` after.

``nodedown``: a cell that runs while NODE2 is set down (``scontrol update``): how long until
the cell ends, and its error text.

``exit``: a pool on Slurm, then the process exits without ``%hvd stop`` (kernel exit).
``idle``: a pool on Slurm with HVD_MAGIC_SLURM_IDLE_TIMEOUT=2, then no cell for 5 s.
``profile``: ``%hvd profiles``, then ``%%hvd --profile slurm2`` (HVD_MAGIC_PROFILE_DIR is set
by the test): its setup lines ran on both nodes, its variables reached the ranks.
``killed``: a pool on Slurm, then ``READY``; the test kills this process with SIGKILL.
"""
import json
import os
import subprocess
import sys
import threading
import time

scenario, node2 = sys.argv[1:3]
res = {}

TRAIN = """
import socket
import torch
import hvd_magic.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
g = torch.Generator().manual_seed(hvd.rank())
x = torch.randn(64, 4, generator=g)
y = x.sum(1, keepdim=True)
losses = []
for step in range(20):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
w = model.weight.detach().flatten().tolist()
(socket.gethostname(), hvd.rank(), hvd.size(), losses[0], losses[-1], w)
"""


def squeue():
    out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True,
                         timeout=20).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def shell_and_magics():
    from IPython.testing.globalipapp import start_ipython
    shell = start_ipython()
    shell.run_line_magic("load_ext", "hvd_magic")
    return shell, shell.magics_manager.registry["HvdMagics"]


def cells():
    shell, mg = shell_and_magics()
    t0 = time.monotonic()
    shell.run_cell_magic("hvd", "-np 4 --slurm --nodes 2 --time 10 --out first", TRAIN)
    res["first_s"] = time.monotonic() - t0
    res["first"] = {str(r): list(v) for r, v in shell.user_ns["first"].items()}
    alloc = mg.manager.slurm.allocation
    res["job"] = alloc.job_id
    res["squeue_live"] = squeue()
    res["hosts"] = [f"{h.name}:{h.slots}" for h in alloc.hosts]
    pool = mg.manager.pool
    shell.run_cell_magic("hvd", "--out second", "hvd.rank(), hvd.size()")
    res["second"] = {str(r): list(v) for r, v in shell.user_ns["second"].items()}
    res["same_pool"] = mg.manager.pool is pool
    shell.run_cell_magic("hvd", "-np 4 --slurm --nodes 2 --time 10 --out third",
                         "hvd.allreduce(torch.ones(1), op=hvd.Sum).item()")
    res["third"] = {str(r): v for r, v in shell.user_ns["third"].items()}
    res["same_job"] = mg.manager.slurm.allocation.job_id == res["job"]
    res["same_pool_3"] = mg.manager.pool is pool
    import io
    from contextlib import redirect_stdout
    buf = io.StringIO()
    with redirect_stdout(buf):
        shell.run_line_magic("hvd", "status")
        t_stop = time.monotonic()
        shell.run_line_magic("hvd", "stop")
        res["stop_s"] = time.monotonic() - t_stop
    res["printed"] = buf.getvalue()
    res["squeue_after"] = squeue()


def nodedown():
    shell, mg = shell_and_magics()
    shell.run_cell_magic("hvd", "-np 4 --slurm --nodes 2 --time 10",
                         "import time, hvd_magic.collectives as hvd\nhvd.init()")
    res["job"] = mg.manager.slurm.allocation.job_id
    downed = {}

    def down():
        time.sleep(2.0)
        downed["t"] = time.monotonic()
        subprocess.run(["scontrol", "update", f"nodename={node2}", "state=down",
                        "reason=hvd-test"], check=True, timeout=20)

    threading.Thread(target=down, daemon=True).start()
    import io
    from contextlib import redirect_stderr
    err = io.StringIO()
    with redirect_stderr(err):
        outcome = shell.run_cell("%%hvd\nimport time\nfor _ in range(600):\n"
                                 "    time.sleep(0.1)\n")
    res["ended_after_s"] = time.monotonic() - downed.get("t", time.monotonic())
    exc = outcome.error_in_exec
    res["error_type"] = type(exc).__name__ if exc is not None else None
    res["error"] = (str(exc) + "\n" + "\n".join(getattr(exc, "__notes__", []))
                    if exc is not None else "")
    res["stderr"] = err.getvalue()[-3000:]
    shell.run_line_magic("hvd", "stop")
    res["squeue_after"] = squeue()


def exit_without_stop():
    shell, mg = shell_and_magics()
    shell.run_cell_magic("hvd", "-np 2 --slurm --nodes 2", "1")
    res["job"] = mg.manager.slurm.allocation.job_id
    res["squeue_live"] = squeue()


def idle():
    os.environ["HVD_MAGIC_SLURM_IDLE_TIMEOUT"] = "2"
    shell, mg = shell_and_magics()
    shell.run_cell_magic("hvd", "-np 2 --slurm --nodes 2", "1")
    res["job"] = mg.manager.slurm.allocation.job_id
    res["squeue_live"] = squeue()
    time.sleep(1.5)
    shell.run_cell_magic("hvd", "", "2")          # a cell: the idle clock starts again
    t_cell = time.monotonic()
    res["squeue_after_cell"] = squeue()
    # the release (pool stop, scancel, then COMPLETING for a second or more under load)
    # takes its time after the 2 s: wait for squeue to empty, up to 20 s
    while squeue() and time.monotonic() - t_cell < 20:
        time.sleep(0.25)
    res["squeue_idle"] = squeue()
    res["idle_after_s"] = time.monotonic() - t_cell
    res["pool_gone"] = mg.manager.pool is None and mg.manager.slurm.allocation is None


def profile():
    import io
    from contextlib import redirect_stdout
    shell, mg = shell_and_magics()
    buf = io.StringIO()
    with redirect_stdout(buf):
        shell.run_line_magic("hvd", "profiles")
    res["profiles"] = buf.getvalue()
    shell.run_cell_magic("hvd", "--profile slurm2 --out where",
                         "import os, socket\n(socket.gethostname(), os.environ.get('HVD_TEST_MARK'))")
    res["where"] = {str(r): list(v) for r, v in shell.user_ns["where"].items()}
    res["job"] = mg.manager.slurm.allocation.job_id
    shell.run_line_magic("hvd", "stop")
    res["squeue_after"] = squeue()


def killed():
    shell, mg = shell_and_magics()
    shell.run_cell_magic("hvd", "-np 2 --slurm --nodes 2", "1")
    print("READY " + json.dumps({"job": mg.manager.slurm.allocation.job_id,
                                 "squeue_live": squeue()}), flush=True)
    time.sleep(120)


if scenario == "killed":
    killed()
else:
    {"cells": cells, "nodedown": nodedown, "exit": exit_without_stop, "idle": idle,
     "profile": profile}[scenario]()
    print("RESULT " + json.dumps(res, default=str), flush=True)
    sys.stdout.flush()   # the process exits here: atexit releases a job still held
