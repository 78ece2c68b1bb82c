"""Writes the notebook used by tests/test_browser.py (``python tests/browser/make_notebooks.py``);
the .ipynb file is committed."""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def nb(cells):
    return {"cells": [{"cell_type": kind, "id": f"cell-{i}", "metadata": {},
                       "source": src.strip("\n").splitlines(True),
                       **({"execution_count": None, "outputs": []} if kind == "code" else {})}
                      for i, (kind, src) in enumerate(cells)],
            "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                        "name": "python3"},
                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


TRAIN = '''
%%hvd -np 2
import time, sys, torch
import hvd_magic.torch as hvd
from hvd_magic.widgets import report
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(64, 64), torch.randn(64, 1)
for step in range(1, STEPS + 1):      # the same count on every rank (a time limit would not be)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    time.sleep(0.002)          # stands in for data loading
    report(samples=64)
    if step % 200 == 0:
        print(f"step {step} loss {loss.item():.4f}")
    if step % 1000 == 0:
        print(f"rank {hvd.rank()} note at step {step}", file=sys.stderr)
print(f"rank {hvd.rank()} finished {step} steps")
'''

ELASTIC = '''
%%hvd -np 3 --min-np 2
import os, signal, time, torch
import hvd_magic.torch as hvd
from hvd_magic.widgets import report
world = hvd.size()
torch.manual_seed(0)
model = torch.nn.Linear(64, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)
x, y = torch.randn(64, 64), torch.randn(64, 1)

@hvd.elastic.run
def train(state):
    while state.step < 600:
        if state.step == 200 and hvd.rank() == 2 and hvd.size() == world:
            os.kill(os.getpid(), signal.SIGKILL)      # a lost host, mid-training
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        time.sleep(0.005)
        report(samples=64)
        state.step += 1
        if state.step % 50 == 0:
            state.commit()

train(state)
print(f"rank {hvd.rank()} of {hvd.size()}: step {state.step}")
'''

LIVE = nb([
    ("code", "%load_ext hvd_magic\n"),
    ("code", TRAIN.replace("STEPS", "1800")),
    ("code", ELASTIC),
])

if __name__ == "__main__":
    (HERE / "live.ipynb").write_text(json.dumps(LIVE, indent=1) + "\n")
    print("wrote", HERE / "live.ipynb")
