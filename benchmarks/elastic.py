"""Cost of elastic training's commit and of a reset after a lost rank, 25 M parameters.

    mpiexec --with-ft ulfm --oversubscribe -n 3 python benchmarks/elastic.py

Model: 5 x Linear(2236, 2236) (25.0 M parameters, 100 MB in float32), SGD with momentum (one
more 100 MB of optimizer state), batch 32, one thread per rank.

* ``commit()``: median of 5, against the peers in the same run: one training step, and
  ``torch.save`` of the same model and optimizer state to a file in /tmp (the checkpoint a
  script would otherwise write).
* reset: the last rank SIGKILLs itself after a commit; the time from the kill to the next
  training step on the survivors (failure detection, restore, communicator shrink, runtime
  restart, and ``sync()`` broadcasting the 200 MB of state from rank 0).
"""
from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time

import torch

import hvd_magic.torch as hvd


def main() -> int:
    torch.set_num_threads(1)
    hvd.init()
    world = hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2236, 2236) for _ in range(5)])
    params = sum(p.numel() for p in model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(32, 2236), torch.randn(32, 2236)
    state = hvd.elastic.TorchState(model, opt, step=0)
    marks: dict = {}

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        state.step += 1
        return time.perf_counter() - t

    @hvd.elastic.run
    def train(state):
        if "lost" in marks:
            marks["resumed"] = time.time()
            step()
            return None
        steps = [step() for _ in range(3)]
        commits = []
        for _ in range(5):
            t = time.perf_counter()
            state.commit()
            commits.append(time.perf_counter() - t)
        saves = []
        with tempfile.TemporaryDirectory() as d:
            for _ in range(3):
                t = time.perf_counter()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                           os.path.join(d, "ckpt.pt"))
                saves.append(time.perf_counter() - t)
        marks.update(step=statistics.median(steps), commit=statistics.median(commits),
                     save=statistics.median(saves))
        hvd.barrier()
        marks["kill"] = time.time()       # the last rank dies right after the barrier
        if hvd.rank() == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            step()

    state.register_reset_callbacks([lambda: marks.setdefault("lost", time.time())])
    train(state)
    if hvd.rank() == 0:
        print(f"model: {params / 1e6:.1f} M parameters; {world} ranks, then {hvd.size()}")
        print(f"commit(): {marks['commit'] * 1e3:.0f} ms = {marks['commit'] / marks['step']:.2f} "
              f"training steps ({marks['step'] * 1e3:.0f} ms) = "
              f"{marks['commit'] / marks['save']:.2f}x torch.save to /tmp ({marks['save'] * 1e3:.0f} ms)")
        print(f"reset: {marks['resumed'] - marks['kill']:.2f} s from the kill to the next step "
              f"on {hvd.size()} ranks")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
